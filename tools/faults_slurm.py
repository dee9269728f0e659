"""Multi-host fault drill under SLURM: jobs of tools/slurm/train.sbatch hit by a cluster's faults.

    python tools/faults_slurm.py [--cases preempt-notice,kill-task,...] [--work DIR] [--fsdp]

Starts a one-node SLURM cluster (tools/slurm/up.sh: root, Debian's slurm-wlm and munge), trains
the 2-task x 2-device Fashion-MNIST job of tools/faults_multihost.py uninterrupted as the
reference (a short run of 3 epochs and a long one of 40, for the cases that wait for a time
limit), then per case starts the job, injects its fault once the epoch-1 checkpoint is committed
(in the long cases SLURM's clock brings it), and measures the seconds until every task hit has
ended. A job cut short is continued (SLURM's requeue, or the same sbatch line again) and its
final weights are compared bit for bit with the reference. Cases:

  preempt-notice  scancel --signal=TERM, the preemption notice, to every task: one agreed step
                  saved, the job requeues itself and resumes
  warning-signal  the script's own --signal=TERM@120 under --time=4, sent by SLURM itself (the
                  long run): as preempt-notice, once or more
  kill-task       SIGKILL of task 1: the job ends, srun names task 1; the sbatch line again resumes
  node-down       the node set DOWN (a failed node): SLURM kills the job and requeues it (--requeue);
                  once the node is back the job resumes
  node-drained    the node set DRAIN (maintenance) mid-run: the job runs to its end untouched
  time-limit      --time=1 reached by a plain srun job without a warning signal (the long run):
                  SIGTERM, SIGKILL 30 s (KillWait) later; it loses at most the steps since the last
                  checkpoint; a new job with --resume continues

Prints a table (case, outcome, seconds until the tasks hit ended, failing task named?, checkpoint
resumed from, resumed exactly?) and a summary line; exits 1 when a case does not behave as
described. Stops the cluster at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import faults_multihost as drill  # noqa: E402 (its data, weights and environment)

ROOT = drill.ROOT
SLURM = os.path.join(ROOT, "tools", "slurm")
SHORT, LONG = 3, 40  # epochs of 8 steps
FIRST = f"ckpt-{drill.TRAIN_IMAGES // drill.BATCH:08d}"  # the epoch-1 checkpoint
CASES = ("preempt-notice", "warning-signal", "kill-task", "node-down", "node-drained", "time-limit")
LONG_CASES = ("warning-signal", "time-limit")
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE")
PATIENCE = 900  # seconds a job may take to reach the state waited for


def listed_tasks(listing: str) -> list[tuple[int, int, int]]:
    """(step, task number, pid) of each srun step task in `scontrol listpids` output (PID JOBID
    STEPID LOCALID GLOBALID), in the order of the task numbers; not the batch script, the extern
    step or a pid of -1."""
    rows = [line.split() for line in listing.splitlines()[1:]]
    tasks = [(int(r[4]), int(r[2]), int(r[0])) for r in rows
             if len(r) == 5 and r[2].isdigit() and r[4].isdigit() and int(r[0]) > 0]
    return [(step, task, pid) for task, step, pid in sorted(tasks)]


class Cluster:
    """SLURM's commands against the cluster of tools/slurm/up.sh in `folder`."""

    def __init__(self, folder: str):
        self.folder = folder
        self.env = drill.environment({
            "SLURM_CONF": os.path.join(folder, "slurm.conf"),
            "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])})
        self.node = self.run("sinfo", "-h", "-o", "%N")

    def run(self, *command: str, check: bool = True) -> str:
        out = subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=120)
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(command)}: {out.stderr.strip()}")
        return out.stdout.strip()

    def job(self, job: str) -> dict[str, str]:
        text = self.run("scontrol", "show", "job", "--oneliner", job)
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def task_pids(self, job: str) -> list[int]:
        """The pids of the job's tasks in the order of their numbers (of its srun steps, not the
        batch script, nor other processes of their process group)."""
        return [pid for _, _, pid in listed_tasks(self.run("scontrol", "listpids", job, check=False))]

    def wait(self, job: str, until, what: str) -> None:
        deadline = time.monotonic() + PATIENCE
        while not until(self.job(job)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job} did not reach {what} in {PATIENCE} s")
            time.sleep(0.2)


def train_args(data: str, epochs: int) -> list[str]:
    return ["fashion-mnist-cnn", "--batch-size", str(drill.BATCH), "--seed", "0", "--epochs", str(epochs),
            "--data-dir", data, "--checkpoint-every", "epoch", "--no-tensorboard", "--simulate-devices", "2",
            *drill.SHARDING]


def sbatch(cluster: Cluster, run: str, log: str, epochs: int, data: str, *options: str) -> str:
    return cluster.run("sbatch", "--parsable", "--ntasks=2", f"--output={log}", "--open-mode=append", *options,
                       os.path.join(SLURM, "train.sbatch"), run, *train_args(data, epochs))


def wait_for_file(cluster: Cluster, job: str, path: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not os.path.isfile(path):
        if cluster.job(job)["JobState"] in ENDED or time.monotonic() > deadline:
            raise RuntimeError(f"job {job} ended or took {PATIENCE} s before {path} was written")
        time.sleep(0.1)


def wait_for_tasks(cluster: Cluster, job: str) -> list[int]:
    """The pids of the job's 2 tasks, once both run."""
    deadline = time.monotonic() + PATIENCE
    while len(pids := cluster.task_pids(job)) < 2:
        if cluster.job(job)["JobState"] in ENDED or time.monotonic() > deadline:
            raise RuntimeError(f"job {job} ended or took {PATIENCE} s before its tasks started")
        time.sleep(0.2)
    return pids


def ended(pids: list[int], start: float) -> float:
    """Seconds from `start` until none of `pids` runs (at most 300)."""
    while any(drill.alive(p) for p in pids) and time.monotonic() - start < 300:
        time.sleep(0.05)
    return time.monotonic() - start


def run_case(case: str, cluster: Cluster, data: str, work: str, references: dict) -> dict:
    run, log = os.path.join(work, case), os.path.join(work, f"{case}.log")
    shutil.rmtree(run, ignore_errors=True)  # else the job would resume an earlier drill's run
    if os.path.exists(log):
        os.remove(log)
    epochs = LONG if case in LONG_CASES else SHORT
    first = os.path.join(run, "checkpoints", FIRST, "manifest.json")
    if case == "time-limit":  # a plain job: no warning signal, no requeue
        command = shlex.join(["srun", "--label", "meshfit", "train", *train_args(data, epochs), "--out", run])
        job = cluster.run("sbatch", "--parsable", f"--output={log}", "--ntasks=2", "--time=1", f"--wrap={command}")
    else:
        job = sbatch(cluster, run, log, epochs, data, *(["--time=4"] if case == "warning-signal" else []))
    pids = wait_for_tasks(cluster, job)
    if case not in LONG_CASES:
        wait_for_file(cluster, job, first)
    start = time.monotonic()
    if case == "preempt-notice":
        cluster.run("scancel", "--signal=TERM", job)
    elif case == "kill-task":
        os.kill(pids[1], signal.SIGKILL)
    elif case == "node-down":
        cluster.run("scontrol", "update", f"nodename={cluster.node}", "state=down", "reason=fault drill")
    elif case == "node-drained":
        cluster.run("scontrol", "update", f"nodename={cluster.node}", "state=drain", "reason=fault drill")
    elif case == "warning-signal":  # SLURM sends it when it will: from the tasks' stop lines on
        cluster.wait(job, lambda j: "stopped by SIGTERM" in read(log) or j["JobState"] in ENDED,
                     "the warning signal")
        start = time.monotonic()
    elif case == "time-limit":
        cluster.wait(job, lambda j: j["JobState"] != "RUNNING", "its time limit")
        start = time.monotonic()
    seconds = ended(pids, start)
    if case == "node-down":
        cluster.wait(job, lambda j: j["JobState"] == "PENDING", "its requeue")
        cluster.run("scontrol", "update", f"nodename={cluster.node}", "state=resume", check=False)  # unless
        # it came back by itself (ReturnToService=2)
    cluster.wait(job, lambda j: j["JobState"] in ENDED, "its end")
    state = cluster.job(job)
    drained = False
    if case == "node-drained":
        drained = "drain" in cluster.run("sinfo", "-h", "-o", "%T")
        cluster.run("scontrol", "update", f"nodename={cluster.node}", "state=resume", check=False)
    again = None
    if state["JobState"] != "COMPLETED":  # ended short and not requeued: the same line resumes it
        if case == "time-limit":
            command = shlex.join(["srun", "--label", "meshfit", "train", *train_args(data, epochs), "--resume", run])
            again = cluster.run("sbatch", "--parsable", f"--output={log}", "--open-mode=append", "--ntasks=2",
                                f"--wrap={command}")
        else:
            again = sbatch(cluster, run, log, epochs, data)
        cluster.wait(again, lambda j: j["JobState"] in ENDED, "the end of the resumed job")
    text = read(log)
    final = (cluster.job(again) if again else state)["JobState"]
    stops = re.findall(r"^(\d): meshfit: training stopped by SIGTERM after step (\d+)", text, re.M)
    resumed = re.findall(r"^0: resuming .* from (ckpt-\d+)", text, re.M)
    outcome = f"{state['JobState'].lower()}, {state['Restarts']} requeue(s)"
    if stops:
        by_step: dict[str, set[str]] = {}
        for task, step in stops:
            by_step.setdefault(step, set()).add(task)
        agreed = all(tasks == {"0", "1"} for tasks in by_step.values())
        outcome += f", both saved and stopped after step {', '.join(by_step)}" if agreed else ", NOT an agreed stop"
    if again:
        outcome += f", then {final.lower()} on resubmission"
    exact = "-"
    if final == "COMPLETED":
        exact = "yes" if all(np.array_equal(a, b) for a, b in zip(drill.weights(run), references[epochs])) \
            else "no (weights differ)"
    named = "-"
    if case == "kill-task":
        named = "yes" if re.search(r"task 1: Killed", text) else "no"
    expected = {"preempt-notice": int(state["Restarts"]) >= 1 and bool(stops),
                "warning-signal": int(state["Restarts"]) >= 1 and bool(stops),
                "kill-task": state["JobState"] == "FAILED" and named == "yes",
                "node-down": int(state["Restarts"]) >= 1,
                "node-drained": state["JobState"] == "COMPLETED" and not resumed and drained,
                "time-limit": state["JobState"] == "TIMEOUT"}[case]
    ok = expected and exact == "yes" and "NOT" not in outcome
    if case == "warning-signal":  # when SLURM sent it is not known here
        seconds = float("nan")
    return {"case": case, "outcome": outcome, "seconds": seconds, "named": named,
            "resumed": ", ".join(resumed) or "-", "exact": exact, "ok": ok,
            "last": next((l for l in reversed(text.splitlines()) if l.startswith(("meshfit job", "srun: error"))), "")}


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    parser.add_argument("--work", help="folder for data, runs and logs (default: a temporary one, removed)")
    parser.add_argument("--fsdp", action="store_true", help="train with --sharding fsdp (kernels of 10 KB and more "
                        "sharded over the 4 devices of the 2 tasks, each task writing its own shards)")
    args = parser.parse_args()
    if args.fsdp:
        drill.SHARDING[:] = ["--sharding", "fsdp", "--fsdp-min-size", "10KB"]
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {', '.join(sorted(unknown))}")
    work = args.work or tempfile.mkdtemp(prefix="meshfit-faults-slurm-")
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "data")
    sys.path.insert(0, ROOT)
    drill.write_data(os.path.join(data, "fashion-mnist"))
    up = subprocess.run(["bash", os.path.join(SLURM, "up.sh")], capture_output=True, text=True)
    if up.returncode:
        print(up.stderr.strip(), file=sys.stderr)
        return 1
    cluster = Cluster(up.stdout.strip())
    try:
        references = {}
        for epochs in sorted({LONG if c in LONG_CASES else SHORT for c in cases}):
            run = os.path.join(work, f"reference-{epochs}")
            shutil.rmtree(run, ignore_errors=True)
            if os.path.exists(run + ".log"):
                os.remove(run + ".log")
            job = sbatch(cluster, run, run + ".log", epochs, data)
            cluster.wait(job, lambda j: j["JobState"] in ENDED, "the reference's end")
            if cluster.job(job)["JobState"] != "COMPLETED":
                print(read(run + ".log")[-3000:], file=sys.stderr)
                return 1
            references[epochs] = drill.weights(run)
        rows = []
        print(f"{'case':<15} {'outcome':<62} {'s to end':>8}  {'named?':<7} {'resumed from':<14} exactly?",
              flush=True)
        for case in cases:
            row = run_case(case, cluster, data, work, references)
            rows.append(row)
            print(f"{row['case']:<15} {row['outcome']:<62} {row['seconds']:8.1f}  {row['named']:<7} "
                  f"{row['resumed']:<14} {row['exact']}", flush=True)
            print(f"{'':<15} {row['last'][:150]}", flush=True)
    finally:
        subprocess.run(["bash", os.path.join(SLURM, "down.sh"), cluster.folder, "--keep"])
    good = sum(r["ok"] for r in rows)
    print(f"summary: {good}/{len(rows)} cases behaved as described; logs in {work} and {cluster.folder}", flush=True)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if good == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
