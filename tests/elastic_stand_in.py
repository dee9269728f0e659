"""A stand-in for `meshfit train` under `meshfit launch --elastic`: tests of the launcher's
decisions (limits, growing back) start processes that take milliseconds instead of training.

    python tests/elastic_stand_in.py launch LAUNCH FLAGS -- train --out RUN [--steps 6]
        [--kill P@S | --kill last] [--hang P@S] [--hold-below N] [--micro-batches K]
        [--finish-on-stop]

`launch` runs meshfit's CLI with the elastic launcher taking this script for `meshfit train`.
`train` is one process of a run, doing what the launcher relies on of `meshfit train`, one
"step" at a time with no clock involved:
- the processes start together (as JAX's joining makes them) and report their steps to the
  launcher (MESHFIT_LAUNCH_STATUS);
- process 0 writes RUN/config.json (global batch, epochs: 1, and "resumed" with the checkpoint
  of each --resume), commits a checkpoint after every step (state.json, then manifest.json) and,
  once all steps ran, metrics.json; exit 0;
- --resume RUN: start from its newest committed checkpoint (config.json's "resumed" entry
  records the --micro-batches the launcher asked for, or null);
- --kill P@S: process P SIGKILLs itself after global step S (--kill last: the highest process,
  after the first step of every job of more than one process; --kill early: before its first
  step, nothing new committed), once process 0 committed that step; the others then print the
  first lines of JAX's abort and wait, as on a collective with a lost peer;
- --hang P@S: process P stops reporting progress after global step S (alive: a hung process for
  the launcher's stall watchdog, MESHFIT_STALL_TIMEOUT), once process 0 committed that step;
  the others report once more (as before a collective) and wait;
- --freeze P@S: process P SIGSTOPs itself after global step S (the launcher's stop continues it);
  --freeze early: the highest process SIGSTOPs itself before its first step in the run's first
  4 generations (a burst of stops from outside, nothing committed in between), the others wait;
- --pause SECONDS: each step takes that long (a generation that trains for a while);
- --hold-below N: a job of fewer than N processes waits after its first checkpoint (for the
  launcher's SIGTERM that grows the mesh back); every wait ends after SAFETY_SECONDS with exit 3;
- SIGTERM: process 0 commits the current step (the agreed save; --stop-ahead: the next one, as
  meshfit train's processes agree on a step ahead of the signal), every process prints train's
  line and exits 143; --finish-on-stop: in a job held by --hold-below, the run's last steps run
  instead and it exits 0, as a run does that finished before the launcher's stop reached it;
- process 0 prints a device report (meshfit connected, 4 rows) as it starts.
"""

import argparse
import json
import os
import signal
import sys
import time

SAFETY_SECONDS = 300  # a wait the launcher never ended: fail instead of hanging the test


def launch(argv: list[str]) -> int:
    from meshfit import cli
    from meshfit.launch import train_argv

    def train_command(command: list[str]) -> tuple[list[str], str]:
        run = train_argv.flag_value(command, "--resume") or train_argv.flag_value(command, "--out")
        return train_argv.without_flag(command, "--resume"), run

    train_argv.train_command = train_command
    return cli.main(["launch", *argv])


def _resumed(run: str) -> list:
    """config.json's "resumed" entries of `run` (one per generation after the first) once process 0
    wrote it for this generation (every process waits for the others before a step)."""
    try:
        with open(os.path.join(run, "config.json")) as f:
            return json.load(f).get("resumed", [])
    except FileNotFoundError:
        return []


def train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--resume")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill")
    parser.add_argument("--hang")
    parser.add_argument("--hold-below", type=int, default=0)
    parser.add_argument("--micro-batches", type=int)
    parser.add_argument("--stop-ahead", action="store_true")
    parser.add_argument("--freeze")
    parser.add_argument("--finish-on-stop", action="store_true")
    parser.add_argument("--pause", type=float, default=0.0)
    args = parser.parse_args(argv)
    run = args.resume or args.out
    # as `meshfit launch` numbers its processes, or as srun its tasks (--via srun)
    index = int(os.environ.get("MESHFIT_PROCESS_ID") or os.environ["SLURM_PROCID"])
    count = int(os.environ.get("MESHFIT_NUM_PROCESSES") or os.environ["SLURM_NTASKS"])
    folder = os.path.join(run, "checkpoints")
    names = sorted(os.listdir(folder)) if args.resume and os.path.isdir(folder) else []
    names = [n for n in names if os.path.isfile(os.path.join(folder, n, "manifest.json"))]
    step = int(names[-1].rpartition("-")[2]) if names else 0
    if index == 0:
        config_path = os.path.join(run, "config.json")
        config = {"recipe": "stand-in", "global_batch": 8, "epochs": 1}
        if args.resume:
            with open(config_path) as f:
                config = json.load(f)
            config.setdefault("resumed", []).append({"checkpoint": names[-1] if names else "none",
                                                     "micro_batches": args.micro_batches,
                                                     "restore_seconds": 0.01})
        os.makedirs(folder, exist_ok=True)
        _write(config_path, config)

    def commit(at: int) -> None:
        path = os.path.join(folder, f"ckpt-{at:08d}")
        if index == 0 and at > 0 and not os.path.isfile(os.path.join(path, "manifest.json")):
            os.makedirs(path, exist_ok=True)
            _write(os.path.join(path, "state.json"), {"global_step": at, "steps_per_epoch": args.steps})
            _write(os.path.join(path, "manifest.json"), {"global_step": at})

    def stop(*_) -> None:  # the agreed save, and the line meshfit train ends with
        if args.finish_on_stop and count < args.hold_below:
            for at in range(step + 1, args.steps + 1):
                done = at - first
                _write(os.path.join(status, f"progress-{index}"), f"{done} {done} {done} python", raw=True)
                commit(at)
            if index == 0:
                _write(os.path.join(run, "metrics.json"), {"test_accuracy": 1.0})
            os._exit(0)
        lost_peer = os.path.isfile(os.path.join(status, "dying"))  # no agreed save without it
        at = min(step + 1, args.steps) if args.stop_ahead and not lost_peer else step
        commit(at)
        print(f"training stopped by SIGTERM after step {at}, saved to {folder}/ckpt-{at:08d}; "
              f"continue with: meshfit train --resume {run}", file=sys.stderr, flush=True)
        os._exit(143)

    signal.signal(signal.SIGTERM, stop)
    status = os.environ["MESHFIT_LAUNCH_STATUS"]  # a folder of this job's own
    if index == 0:  # meshfit.watch.keras_side.report.discovery_text's report
        print(f"meshfit connected\n  hosts            {count} (this is process 0)\n  devices per host 1\n"
              f"  replicas         {count}\n  engine           keras on jax", flush=True)
    _write(os.path.join(status, f"ready-{index}"), "")  # all start from the same step, as on joining
    for i in range(count):
        _wait(until=os.path.join(status, f"ready-{i}"))
    first = step
    who, _, when = (args.kill or "none@0").partition("@")
    if who == "early" and count > 1:  # nothing new committed: a loss without progress
        if index == count - 1:
            _write(os.path.join(status, "dying"), "")
            os.kill(os.getpid(), signal.SIGKILL)
        _wait(until=os.path.join(status, "dying"))
        _abort_as_jax_does(index)
        _wait()
    if args.freeze == "early" and len(_resumed(run)) < 4:
        if index == count - 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # until the launcher kills it: lost before a step
        _wait()  # the others, in their first collective
    victim, when = (count - 1, first + 1) if who == "last" else (int(who), int(when)) \
        if who.isdigit() else (None, 0)
    while step < args.steps:
        step += 1
        done = step - first  # the progress report the launcher reads (meshfit.parallel.heartbeat)
        _write(os.path.join(status, f"progress-{index}"), f"{done} {done} {done} python", raw=True)
        commit(step)
        time.sleep(args.pause)
        if (count > 1 or who.isdigit()) and victim is not None and victim < count and step == when:
            if index == victim:  # once step S is committed, as a collective would have waited
                _wait(until=os.path.join(folder, f"ckpt-{step:08d}", "manifest.json"))
                _write(os.path.join(status, "dying"), "")
                os.kill(os.getpid(), signal.SIGKILL)
            _wait(until=os.path.join(status, "dying"))
            _abort_as_jax_does(index)
            _wait()
        if args.freeze not in (None, "early") and (index, step) == tuple(map(int, args.freeze.split("@"))):
            os.kill(os.getpid(), signal.SIGSTOP)  # until the launcher's SIGTERM and SIGCONT
        if count > 1 and args.hang and step == int(args.hang.partition("@")[2]):
            _wait(until=os.path.join(folder, f"ckpt-{step:08d}", "manifest.json"))
            if index != int(args.hang.partition("@")[0]):  # one report ahead of the hung one
                _write(os.path.join(status, f"progress-{index}"), f"{done} {done + 1} {done} python",
                       raw=True)
            _wait()
        if count < args.hold_below and step == first + 1:
            _wait()
    if index == 0:
        _write(os.path.join(run, "metrics.json"), {"test_accuracy": 1.0})
    return 0


def _abort_as_jax_does(index: int) -> None:
    """A survivor's end as JAX's coordination service makes it (its first lines): after its peer."""
    time.sleep(0.05)
    print(f"E1128 10:00:00.000000   {index} coordination_service_agent.cc:332] Polled an error "
          "from coordination service", file=sys.stderr)
    print(f"F1128 10:00:00.000000   {index} client.h:80] Terminating process because the JAX "
          "distributed service detected fatal errors", file=sys.stderr)
    print("*** Check failure stack trace: ***\n    @     0x7f0000000000  (unknown)", file=sys.stderr,
          flush=True)


def _wait(until: str | None = None) -> None:
    """Wait for SIGTERM (or until the file `until` exists); exit 3 after SAFETY_SECONDS."""
    for _ in range(SAFETY_SECONDS * 100):
        if until and os.path.isfile(until):
            return
        time.sleep(0.01)
    os._exit(3)


def _write(path: str, data, raw: bool = False) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(data if raw else json.dumps(data))
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(launch(sys.argv[2:]) if sys.argv[1] == "launch" else train(sys.argv[2:]))
