"""`meshfit launch --elastic --via srun` (meshfit.launch.slurm_step): what the launcher reads of
srun's lines, and which nodes it leaves out of the next step. The real runs, on a one-node SLURM
cluster, are in test_schedulers.py; a one-node cluster cannot lose a node, so that logic is here,
with scontrol and sinfo's answers stood in for.
"""

import io
import os
import queue
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from meshfit.launch import elastic, growth, local, slurm_step
from meshfit.launch.output import Output
from meshfit.errors import MeshfitError


def test_srun_s_lines_of_a_task_s_end_give_its_exit_code():
    assert slurm_step.task_numbers("1") == [1]
    assert slurm_step.task_numbers("0-2,5") == [0, 1, 2, 5]
    assert slurm_step.exit_code("Killed") == -signal.SIGKILL
    assert slurm_step.exit_code("Aborted (core dumped)") == -signal.SIGABRT
    assert slurm_step.exit_code("Exited with exit code 143") == 143
    ended = slurm_step.TASK_END.match("srun: error: node7: tasks 0-1: Exited with exit code 143")
    assert ended.group("node") == "node7" and ended.group("tasks") == "0-1"


def step(tmp_path, tasks=4, show="all"):
    """A Step without srun: its line routing, exits and status folder."""
    s = object.__new__(slurm_step.Step)
    s.job, s.name, s.status, s.show, s.exits = "7", "meshfit-generation-1", str(tmp_path), show, queue.Queue()
    s.signalled, s.failed_nodes, s.lock, s.pumps = set(), set(), threading.Lock(), []
    s.output = Output()
    s.tasks = s.output.processes = [slurm_step.Task(i, s) for i in range(tasks)]
    return s


def test_a_step_s_lines_go_to_their_task_and_its_end_to_the_launcher(tmp_path):
    s, out = step(tmp_path), io.StringIO()
    s.line("1: epoch 1/4  loss 2.3", out)
    s.line("srun: error: n1: task 1: Killed", out)
    s.line("srun: Job step aborted: Waiting up to 32 seconds for job step to finish.", out)
    assert out.getvalue() == "[1] epoch 1/4  loss 2.3\n"  # srun's own lines are the launcher's
    assert list(s.tasks[1].tail) == ["epoch 1/4  loss 2.3"]
    assert s.exits.get_nowait() == (1, -signal.SIGKILL) and s.tasks[1].node == "n1"
    assert s.tasks[1].poll() == -signal.SIGKILL and s.tasks[0].poll() is None
    s.line("0: a survivor's error after its peer's end", out)  # kept out of sight: the launcher's
    assert out.getvalue() == "[1] epoch 1/4  loss 2.3\n" and s.tasks[0].tail[-1].startswith("a survivor")
    s.line("srun: error: n1: tasks 0-1: Killed", out)  # a task's first end counts
    assert s.exits.get_nowait() == (0, -signal.SIGKILL) and s.exits.empty()


def test_a_node_srun_reports_failed_ends_the_tasks_that_joined_there(tmp_path, monkeypatch):
    monkeypatch.setattr(slurm_step, "hostnames", lambda nodelist: nodelist.split(","))
    for index, node in enumerate(["n1", "n1", "n2", "n2"]):
        (tmp_path / f"joining-{index}").write_text(node)
    s = step(tmp_path)
    s.line("srun: error: Node failure on n2", io.StringIO())
    assert sorted(s.exits.get_nowait() for _ in range(2)) == [(2, -signal.SIGKILL), (3, -signal.SIGKILL)]
    assert s.failed_nodes == {"n2"} and s.tasks[3].node == "n2"


def test_a_frozen_task_on_the_launchers_node_is_seen_in_proc(tmp_path):
    """A task's joining marker names its node and pid: the launcher reads the state of the tasks
    on its own node (SIGSTOP: T, lost as launch loses its own processes), and of no other
    process (another node's, or a pid that does not hold this step's status folder)."""
    import subprocess
    import sys

    from meshfit import env
    from meshfit.parallel import heartbeat

    task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, env.LAUNCH_STATUS: str(tmp_path)})
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        here = heartbeat.this_node()
        (tmp_path / "joining-0").write_text(f"{here} {task.pid}")
        (tmp_path / "joining-1").write_text(f"elsewhere {task.pid}")
        (tmp_path / "joining-2").write_text(f"{here} {stranger.pid}")
        (tmp_path / "joining-3").write_text("n9")  # a marker of before pids: a node alone
        s = step(tmp_path)
        assert heartbeat.nodes(str(tmp_path)) == {0: here, 1: "elsewhere", 2: here, 3: "n9"}
        assert s.tasks[0].state() in ("S", "R")
        os.kill(task.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30  # the stop is delivered asynchronously
        while s.tasks[0].state() != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.tasks[0].state() == "T" and s.tasks[0].pid == task.pid
        assert [s.tasks[i].state() for i in (1, 2, 3)] == [None, None, None]
        assert [s.tasks[i].elsewhere for i in (1, 2, 3)] == [True, False, True]  # not read again
    finally:
        for p in (task, stranger):
            p.kill()
            p.wait()


def srun_runner(monkeypatch, nodes, up):
    """An Srun runner of a 4-task allocation whose scontrol says `nodes`, sinfo `up`."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setattr(slurm_step.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(slurm_step, "allocation_nodes", lambda job: list(nodes))
    monkeypatch.setattr(slurm_step, "usable", lambda names: set(up) & set(names))
    return slurm_step.Srun("run")


def ended_on(nodes, failed=()):
    tasks = [SimpleNamespace(node=node, failed_nodes=set(failed)) for node in nodes]
    return local.Ended(tasks, None, {}, (2, -signal.SIGKILL), [], "", 15, [], {}, 1.0)


def test_a_lost_node_is_excluded_and_its_tasks_come_back_only_with_it(monkeypatch):
    nodes, up = ["n1", "n2"], {"n1"}
    runner = srun_runner(monkeypatch, nodes, up)
    assert runner.tasks == 4 and runner.most(4) == 4
    runner.note_lost(ended_on(["n1", "n1", "n2", "n2"]), [2, 3])  # n2 is down: a lost node
    assert runner.lost_nodes == {"n2": 2} and runner.most(4) == 2
    srun = slurm_step.srun_command(2, "g2", nodes, set(runner.lost_nodes))
    assert "--exclude=n2" in srun and "--nodes=1-1" in srun and "--ntasks=2" in srun
    # SLURM took it out of the allocation (--no-kill): nothing to exclude, and no growing back
    assert "--exclude=n2" not in slurm_step.srun_command(2, "g2", ["n1"], {"n2"})
    up.add("n2")  # set DOWN and RESUMEd while still in the allocation: it counts again
    assert runner.most(4) == 4 and runner.lost_nodes == {}


def test_a_task_lost_on_a_node_that_is_up_is_a_crash_its_slot_comes_back(monkeypatch):
    runner = srun_runner(monkeypatch, ["n1", "n2"], {"n1", "n2"})
    runner.note_lost(ended_on(["n1", "n1", "n2", "n2"]), [2])
    assert runner.lost_nodes == {} and runner.most(4) == 4
    # but a node srun named failed is lost, up or not (its slurmd may answer before its tasks)
    runner.note_lost(ended_on(["n1", "n1", "n2", "n2"], failed=["n2"]), [2, 3])
    assert runner.lost_nodes == {"n2": 2}


def test_the_growing_boundary_waits_for_room(tmp_path):
    run = str(tmp_path)
    path = os.path.join(run, "checkpoints", "ckpt-00000004")
    room = []
    boundary = growth.NextCheckpoint(run, lambda: bool(room))
    os.makedirs(path)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write("{}")
    assert not boundary()  # no room at ckpt-4: asked once, the next checkpoint asks again
    room.append(1)
    assert not boundary()


def test_via_srun_runs_inside_an_allocation_only(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(MeshfitError, match="--via srun runs inside a SLURM allocation"):
        elastic.elastic_launch(["meshfit", "train", "--out", "r"], None, via="srun")
    with pytest.raises(MeshfitError, match="--processes N is needed"):
        elastic.elastic_launch(["meshfit", "train", "--out", "r"], None)
    srun_runner(monkeypatch, ["n1"], {"n1"})  # an allocation of 4 tasks
    with pytest.raises(MeshfitError, match="--processes 5 is more than the allocation's 4 tasks"):
        elastic.elastic_launch(["meshfit", "train", "--out", "r"], 5, via="srun")
