"""Local copies of the training state (meshfit.run.local_copies): taken every N global steps by
each host's writer, kept 2 deep, skipped where the state is sharded across processes, and taken
by --resume only when newer than the newest committed checkpoint and present for every process.
The 2-process job that resumes from one after a SIGKILL: tests/test_elastic.py."""

import os
from types import SimpleNamespace

import numpy as np
import pytest

from meshfit import env
from meshfit.launch import mesh_history, train_argv
from meshfit.run import checkpoint_format, local_copies, rundir

STEPS = 10  # steps per epoch of the copies here


@pytest.fixture
def host(tmp_path, monkeypatch):
    monkeypatch.setenv(env.LOCAL_COPIES, str(tmp_path / "local"))
    return local_copies.Host(str(tmp_path / "run"))


def small_model(strategy):
    import keras

    from meshfit import recipes

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = recipes.get("mnist-mlp-bf16").build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.optimizer.build(model.trainable_variables)
    return model


def checkpointer_for(model, directory, local_folder, **kwargs):
    from meshfit.run.keras_side.checkpoints import Checkpointer

    checkpointer = Checkpointer(str(directory), STEPS, local_directory=local_folder,
                                extra=lambda: {"seed": 7, "history": [{"epoch": 1}]}, **kwargs)
    checkpointer.set_model(model)
    checkpointer.on_train_begin()
    return checkpointer


def steps_through(checkpointer, epoch, batches):
    checkpointer.on_epoch_begin(epoch)
    for batch in batches:
        checkpointer.on_train_batch_begin(batch)


def test_the_copies_are_of_one_run_in_a_host_local_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(env.LOCAL_COPIES, str(tmp_path / "local"))
    a, b = local_copies.folder_of("runs/a"), local_copies.folder_of(os.path.abspath("runs/a"))
    assert a == b and a.startswith(str(tmp_path / "local")) and os.path.basename(a).startswith("a-")
    assert local_copies.folder_of("other/a") != a  # the same name elsewhere: another run
    monkeypatch.delenv(env.LOCAL_COPIES)
    assert os.path.dirname(local_copies.folder_of("runs/a")).endswith("meshfit-local-copies")


def test_one_process_per_host_writes(host):
    other = local_copies.Host("another process")
    other.folder = host.folder
    assert host.take() and not other.take()  # the second process on this host: a reader
    host.close()
    assert other.take()
    other.close()


def test_copies_at_every_n_steps_not_beside_a_save_newest_two_kept(strategy, tmp_path, host):
    model = small_model(strategy)
    host.take()
    checkpointer = checkpointer_for(model, tmp_path / "run" / "checkpoints", host.folder,
                                    every_steps=6, epoch_end=False, local_every=2)
    steps_through(checkpointer, 0, range(5))  # copies after steps 2 and 4
    checkpointer.wait_local()
    assert host.steps() == [2, 4]
    os.makedirs(host.path(5))  # a copy cut short by a kill (no manifest): not a copy
    assert host.steps() == [2, 4]
    steps_through(checkpointer, 0, range(5, 10))  # 6: a committed save instead; 8
    checkpointer.on_train_end()
    assert host.steps() == [4, 8]  # the newest 2, and the debris cleared
    assert sorted(os.listdir(host.folder)) == [local_copies.LOCK, "ckpt-00000004", "ckpt-00000008"]
    assert [os.path.basename(p) for p in rundir.list_checkpoints(tmp_path / "run" / "checkpoints")] \
        == ["ckpt-00000006"]
    reader = checkpointer_for(model, tmp_path / "run" / "checkpoints", None, local_every=2)
    steps_through(reader, 1, range(5))  # another process on the host: no copy, no other work
    assert host.steps() == [4, 8]


def test_a_copy_is_the_state_a_committed_checkpoint_keeps(strategy, tmp_path, host):
    """Exact resume: the same state.json (data position, seed, history...) and arrays as a
    committed checkpoint of the same step; restored, the model is as it was."""
    import keras

    from meshfit.run.keras_side import checkpoint_restore, checkpoint_save

    model = small_model(strategy)
    host.take()
    checkpointer = checkpointer_for(model, tmp_path / "ckpt", host.folder, epoch_end=False,
                                    local_every=3)
    steps_through(checkpointer, 1, range(3))  # global steps 10, 11, 12: a copy after 12
    checkpointer.wait_local()
    copy = host.path(STEPS + 2)
    committed = checkpoint_save.save(tmp_path / "ckpt", model, epoch=1, step=2, steps_per_epoch=STEPS,
                                     extra=checkpointer.extra(), sharded=False)
    mine, theirs = checkpoint_format.read_state(copy), checkpoint_format.read_state(committed)
    assert {**mine, "saved_at": None} == {**theirs, "saved_at": None}
    assert (mine["epoch"], mine["step"], mine["global_step"], mine["seed"]) == (1, 2, 12, 7)
    a, b = checkpoint_format.read_arrays(copy), checkpoint_format.read_arrays(committed)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    want = [keras.ops.convert_to_numpy(v) for v in model.variables]
    for v in model.trainable_variables:
        v.assign(np.zeros(v.shape))
    checkpoint_restore.restore(model, copy)
    assert all(np.array_equal(keras.ops.convert_to_numpy(v), w) for v, w in zip(model.variables, want))


class Shard:
    def __init__(self, index, data):
        self.index, self.data = index, data


def multi_process_value(shards, shape=(4, 2)):
    """A stand-in for a JAX array of a job of several processes with these addressable shards."""
    return SimpleNamespace(is_fully_addressable=False, is_fully_replicated=False, shape=shape,
                           size=int(np.prod(shape)), dtype=np.dtype("float32"),
                           addressable_shards=shards)


def test_state_sharded_across_processes_gets_no_copy_and_says_why_once(tmp_path, host, capsys):
    from meshfit.run.keras_side import checkpoint_save

    full = np.arange(8, dtype="float32").reshape(4, 2)
    whole_here = multi_process_value([Shard((slice(0, 2), slice(None)), full[:2]),
                                      Shard((slice(2, 4), slice(None)), full[2:]),
                                      Shard((slice(2, 4), slice(None)), full[2:])])  # two devices
    half = multi_process_value([Shard((slice(0, 2), slice(None)), full[:2])])  # fsdp over hosts
    variable = SimpleNamespace(path="dense/kernel", value=whole_here)
    model = SimpleNamespace(variables=[variable], optimizer=None, metrics_variables=[])
    assert checkpoint_save.not_whole_here(model) is None
    np.testing.assert_array_equal(checkpoint_save._host_value(variable), full)  # its own shards
    variable.value = half
    assert checkpoint_save.not_whole_here(model) == "dense/kernel"
    with pytest.raises(ValueError, match="sharded across processes"):
        checkpoint_save._host_value(variable)
    checkpointer = checkpointer_for(model, tmp_path / "ckpt", host.folder, local_every=2)
    assert (checkpointer.local_every, checkpointer.local_directory) == (0, None)
    assert capsys.readouterr().out == ("no local copies: dense/kernel is sharded across processes "
                                       "(each holds only its part); resuming takes the committed "
                                       "checkpoints\n")


def test_the_agreed_copy_is_newer_than_the_committed_one_and_every_process_has_it():
    assert local_copies.agreed_step([[4, 6], [4, 6]], committed=5) == 6
    assert local_copies.agreed_step([[4, 6], [4]], committed=3) == 4  # 6 cut short on a host
    assert local_copies.agreed_step([[4, 6], [4]], committed=5) is None  # 4: older than committed
    assert local_copies.agreed_step([[4, 6], []], committed=-1) is None  # a host without copies
    assert local_copies.agreed_step([[6, -1]], committed=6) is None  # as new: the checkpoint


def commit_fake(folder, step):
    path = os.path.join(folder, checkpoint_format.checkpoint_name(step))
    os.makedirs(path)
    rundir.write_json(os.path.join(path, rundir.CHECKPOINT_MANIFEST), {})
    return path


@pytest.mark.parametrize("committed, others, chosen", [
    ([4], None, 6),  # one process: its newest copy, newer than ckpt-4
    ([4, 8], None, None),  # the committed checkpoint is newer
    ([4], [6, -1, -1, -1], 6),  # the other process's host has it too
    ([4], [5, -1, -1, -1], 5),  # its host lacks 6: the newest both have
    ([4], [-1, -1, -1, -1], None),  # its host has none: the committed checkpoint
])
def test_resume_takes_the_newest_copy_only_when_newer_and_everyone_has_it(
        tmp_path, host, monkeypatch, committed, others, chosen):
    from jax.experimental import multihost_utils

    from meshfit.run.keras_side import fitting

    host.take()
    os.makedirs(host.folder, exist_ok=True)
    for step in (5, 6):
        path = commit_fake(host.folder, step)
    monkeypatch.setattr(checkpoint_format, "verify", lambda path: None)  # the fakes are intact
    checkpoints = [commit_fake(str(tmp_path / "run" / "checkpoints"), s) for s in committed][::-1]
    if others is not None:
        monkeypatch.setattr(fitting.cluster, "multi_process", lambda: True)
        monkeypatch.setattr(multihost_utils, "process_allgather",
                            lambda row: np.stack([row, np.array(others)]))
    found = fitting.newest_local_copy(host, checkpoints)
    assert found == (None if chosen is None else host.path(chosen))
    assert path == host.path(6)


def test_the_resumed_record_names_the_copy_so_the_launcher_counts_its_steps(tmp_path, host):
    from meshfit.run.keras_side import fitting

    state = {"path": host.path(13), "local": True}
    assert fitting.resumed_from(state) == "local:ckpt-00000013"
    assert mesh_history.checkpoint_step(fitting.resumed_from(state)) == 13
    assert fitting.resumed_from({"path": "run/checkpoints/ckpt-00000012"}) == "ckpt-00000012"


def test_a_copy_newer_than_the_lost_generation_s_last_report_runs_nothing_again():
    lost = {"last_step": 4}  # its progress, reported once a second, lags the copy of step 5
    mesh_history.continued(lost, {"first_step": 5})
    assert (lost["last_step"], lost["lost_steps"]) == (5, 0)
    mesh_history.continued(lost, {"first_step": 2})
    assert (lost["last_step"], lost["lost_steps"]) == (5, 3)


def test_resuming_drops_newer_copies_and_the_finished_run_removes_them(host):
    host.take()
    for step in (4, 6, 8):
        commit_fake(host.folder, step)
    host.drop_newer(6)
    assert [local_copies.step_of(p) for p in rundir.list_checkpoints(host.folder)] == [4, 6]
    host.remove()
    assert not os.path.exists(host.folder)


def test_elastic_launch_turns_local_copies_on_unless_given():
    argv, _ = train_argv.train_command(["python", "-m", "meshfit", "train", "x", "--out", "r"])
    assert argv[argv.index("--local-copy-every") + 1] == train_argv.ELASTIC_LOCAL_COPY_EVERY
    argv, _ = train_argv.train_command(["python", "-m", "meshfit", "train", "--local-copy-every=0"])
    assert argv.count("--local-copy-every") == 0 and "--local-copy-every=0" in argv


def test_a_negative_setting_is_a_one_line_error():
    from meshfit.errors import MeshfitError
    from meshfit.run.options import TrainOptions

    with pytest.raises(MeshfitError, match="--local-copy-every '-1' is not understood; use a step"):
        TrainOptions(local_copy_every=-1)
    assert [TrainOptions(local_copy_every=v).local_copy_every for v in ("5", 5, "off", 0, None)] == \
        [5, 5, 0, 0, None]
