"""The chaos drill: an elastic job that loses a random process at random moments, against the
same command without faults, in one sitting.

    python tools/chaos.py --data-dir ../shared/data --every 30 [--minutes 10] [--seed S]
        [--processes 2] [--devices-per-process 4] [--signals KILL,STOP] [--no-baseline]
        [--via local|srun] [--launch 'LAUNCH FLAGS'] [--] [TRAIN ARGS]

runs `meshfit launch --processes P --devices-per-process D --show first --elastic [LAUNCH FLAGS] -- meshfit train
fashion-mnist-cnn --data-dir DIR --out RUN [TRAIN ARGS]` (with --via srun: `salloc --no-kill
--ntasks=P meshfit launch ... --elastic --via srun -- meshfit train ... --simulate-devices D`, each
generation an srun step of that allocation, on the SLURM cluster SLURM_CONF names; the faults go
to the newest step's tasks, found with `scontrol listpids`) twice: first without faults (the
baseline, unless --no-baseline), then with a fault on average every --every seconds (exponential
gaps drawn from --seed, printed so that any run can be repeated) for --minutes or until the job
ends: SIGKILL or SIGSTOP (--signals, drawn at random) to a random process of the newest
generation, process 0 (the coordinator) included, whatever it is doing then (a step, a save, an
evaluation, a mesh change: the moments are not chosen). It prints one line per fault and ends
with the table of BENCHMARKS.md section 6: the exit codes, faults, the recovery time of each
(from the fault to the first training step of the next generation: median and max, and the
medians of its parts: stop, start, first step), steps run again, goodput, and the throughput ratio to the baseline (the job's steps are the same, so the
ratio of the wall times).

A SIGSTOPped process is noticed by the launcher (its state in /proc, after 0.5 s,
meshfit.launch.watchdog.FROZEN_SECONDS) or by JAX's heartbeat check: the drill sets
MESHFIT_HEARTBEAT_TIMEOUT to --heartbeat-timeout (default 10 s) for both runs, or that wait (60 s
by default) would bound what the launcher's check does not see. Reads the job's progress as
tools/elastic_drill.py does: each generation's status folder in a TMPDIR of the drill's own
(meshfit.parallel.heartbeat).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from elastic_drill import run_metrics, status_folders  # noqa: E402
from faults_slurm import listed_tasks  # noqa: E402

from meshfit.parallel import heartbeat  # noqa: E402

PIDS = re.compile(r"pids ([\d ]+)")  # the launcher's line naming each generation's processes
GRANTED = re.compile(r"^salloc: Granted job allocation (\d+)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--every", type=float, default=30.0, help="mean seconds between faults")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long faults come")
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--signals", default="KILL,STOP")
    parser.add_argument("--heartbeat-timeout", type=int, default=10)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--via", choices=("local", "srun"), default="local",
                        help="srun: the generations are srun steps of an allocation (salloc) of the "
                             "SLURM cluster SLURM_CONF names (tools/slurm/up.sh starts one)")
    parser.add_argument("--launch", default="", metavar="FLAGS", help="more `meshfit launch` flags, "
                        "e.g. '--on-loss shrink --spares 0' (the behaviour before spares)")
    parser.add_argument("train", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.via == "srun" and subprocess.run(["sinfo", "-h"], capture_output=True).returncode:
        sys.exit("chaos: --via srun needs a SLURM cluster: tools/slurm/up.sh prints its folder DIR; "
                 "export SLURM_CONF=DIR/slurm.conf")
    seed = int(time.time()) if args.seed is None else args.seed
    print(f"CHAOS: --seed {seed}: a fault every {args.every:g} s on average for {args.minutes:g} "
          f"minutes, signals {args.signals}", flush=True)
    extra = [a for a in args.train if a != "--"]
    baseline = None if args.no_baseline else run_job(args, extra, faults=None)
    chaos = run_job(args, extra, faults=Faults(random.Random(seed), args.every, args.minutes * 60,
                                               args.signals.split(",")))
    print(table(baseline, chaos), flush=True)
    return chaos["exit"]


class Faults:
    """When and where the faults come: exponential gaps of mean `every` seconds up to `horizon`
    seconds, a random process of the newest generation and a random signal of `signals`."""

    def __init__(self, rng: random.Random, every: float, horizon: float, signals: list[str]):
        self.rng, self.every, self.horizon, self.signals = rng, every, horizon, signals
        self.sent: list[dict] = []  # each fault: seconds into the launch, process, pid, signal

    def next_gap(self) -> float:
        return self.rng.expovariate(1.0 / self.every)

    def strike(self, pids: list[int], at: float) -> dict | None:
        """Send a drawn signal to a drawn process of `pids`; the fault's record (None when it
        had ended already)."""
        index = self.rng.randrange(len(pids))
        name = self.rng.choice(self.signals)
        try:
            os.kill(pids[index], getattr(signal, "SIG" + name))
        except ProcessLookupError:
            return None
        fault = {"at": at, "process": index, "pid": pids[index], "signal": "SIG" + name}
        self.sent.append(fault)
        return fault


def launch_command(args, run: str, extra: list[str]) -> list[str]:
    """The drill's command: `meshfit launch --elastic` of this machine's processes, or (--via
    srun) of srun steps in an allocation salloc holds, --no-kill as tools/slurm/elastic.sbatch
    asks (each task's devices given to train: the launcher reads them there)."""
    train = ["meshfit", "train", "fashion-mnist-cnn", "--data-dir", args.data_dir, "--out", run, *extra]
    launch = [sys.executable, "-m", "meshfit", "launch", "--show", "first", "--elastic", *args.launch.split()]
    if args.via == "srun":
        return ["salloc", "--no-kill", f"--ntasks={args.processes}", *launch, "--via", "srun", "--",
                *train, "--simulate-devices", str(args.devices_per_process)]
    return [*launch, "--processes", str(args.processes), "--devices-per-process",
            str(args.devices_per_process), "--", *train]


def task_pids(job: str) -> list[int]:
    """The pids of the tasks of allocation `job`'s newest srun step, in the order of their task
    numbers (`scontrol listpids`, read by faults_slurm.listed_tasks)."""
    listed = subprocess.run(["scontrol", "listpids", job], capture_output=True, text=True, timeout=30)
    tasks = listed_tasks(listed.stdout)
    newest = max((step for step, _, _ in tasks), default=None)
    return [pid for step, _, pid in tasks if step == newest]


def run_job(args, extra: list[str], faults: Faults | None) -> dict:
    """Run the command once (with `faults` striking, if any); what the table needs of it."""
    run = os.path.join(tempfile.mkdtemp(prefix="chaos-"), "run")
    command = launch_command(args, run, extra)
    print(("CHAOS: with faults: $ " if faults else "CHAOS: baseline: $ ") + " ".join(command), flush=True)
    status = tempfile.mkdtemp(prefix="chaos-tmp-")
    # Where the generations' status folders appear: the launcher's TMPDIR, or under srun beside
    # the run directory (meshfit.launch.slurm_step: storage every node reads).
    folders_in = os.path.dirname(run) if args.via == "srun" else status
    began = time.monotonic()
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "TMPDIR": status,
                                "MESHFIT_HEARTBEAT_TIMEOUT": str(args.heartbeat_timeout)})
    pids: list[list[int]] = []
    allocation: list[str] = []  # under srun: salloc's job id

    def read() -> None:
        for line in job.stdout:
            found = PIDS.search(line)
            if found:
                pids.append([int(p) for p in found.group(1).split()])
            granted = GRANTED.search(line)
            if granted:
                allocation.append(granted.group(1))
            if line.startswith(("meshfit", "salloc")):  # the launcher's, train's and salloc's lines
                sys.stdout.write(f"[{time.monotonic() - began:6.1f} s] {line}")
                sys.stdout.flush()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    generations: dict[str, dict] = {}  # each generation's status folder: when things were seen
    due = began + faults.next_gap() if faults else None
    while job.poll() is None:
        now = time.monotonic()
        watch_generations(generations, status_folders(folders_in), now - began)
        if due is not None and now >= due and (pids or allocation):
            newest = task_pids(allocation[0]) if allocation else pids[-1]
            if now - began > faults.horizon:
                due = None
            elif newest:
                fault = faults.strike(newest, now - began)
                if fault:
                    print(f"CHAOS: [{fault['at']:6.1f} s] {fault['signal']} to process "
                          f"{fault['process']} of {len(newest)} (pid {fault['pid']})", flush=True)
                due = now + faults.next_gap()
        time.sleep(0.05)
    reader.join(timeout=10)
    wall = time.monotonic() - began
    metrics = run_metrics(run)
    watch_generations(generations, [], wall)
    seen = sorted(generations.values(), key=lambda g: g["appeared"])
    return {"exit": job.returncode, "wall": wall, "metrics": metrics, "run": run,
            "faults": faults.sent if faults else [], "generations": seen,
            "first_steps": [g["first_step"] for g in seen if g["first_step"] is not None]}


def watch_generations(generations: dict[str, dict], folders: list[str], now: float) -> None:
    """Note what each generation's status folder shows now (seconds into the launch): when it
    appeared (its processes started), when a process first reported from its training loop
    (meshfit.parallel.heartbeat: start-up, imports, joining, data, model and restore done), its
    first training step (compiled and dispatched: a process began its second dispatch), when it
    was gone (all its processes ended). Resolution: the drill's poll (50 ms); the progress files
    are rewritten at once as the first two dispatches begin, else at most once a second."""
    for folder in folders:
        seen = generations.setdefault(folder, {"appeared": now, "reporting": None, "first_step": None,
                                               "gone": None})
        if seen["first_step"] is None:
            found = heartbeat.progress(folder)
            if found and seen["reporting"] is None:
                seen["reporting"] = now
            if any(c[2] >= 2 for c in found.values()):
                seen["first_step"] = now
    for folder, seen in generations.items():
        if folder not in folders and seen["gone"] is None:
            seen["gone"] = now


def change_parts(fault: float, generations: list[dict]) -> dict[str, float] | None:
    """Where a fault's recovery went: stop (the fault to the end of the generation it struck:
    noticing the loss, stopping the others), start (the next generation's processes started to
    their training loop's first report: process start, imports, jax.distributed, data, model,
    restore), first step (to its first training step compiled and dispatched); None when
    no generation followed."""
    struck = [g for g in generations if g["appeared"] <= fault]  # the newest then
    after = next((g for g in generations if g["appeared"] > fault and g["first_step"] is not None
                  and g["reporting"] is not None), None)
    if after is None:
        return None
    gone = struck[-1]["gone"] if struck and struck[-1]["gone"] is not None else fault
    return {"stop": max(gone - fault, 0.0), "start": after["reporting"] - after["appeared"],
            "first step": after["first_step"] - after["reporting"]}


def recoveries(faults: list[float], first_steps: list[float]) -> list[float | None]:
    """Seconds from each fault to the first training step of a generation that started after it
    (the first step seen after the fault; None when none came: the job ended first)."""
    return [next((s - at for s in first_steps if s > at), None) for at in faults]


def table(baseline: dict | None, chaos: dict) -> str:
    """The drill's table (markdown): faults, recovery times and where they went, steps run
    again, goodput, throughput ratio to the baseline."""
    times = [r for r in recoveries([f["at"] for f in chaos["faults"]], chaos["first_steps"]) if r is not None]
    goodput = chaos["metrics"].get("goodput", {})
    generations = chaos["metrics"].get("generations") or []
    again = sum(g.get("lost_steps", 0) for g in generations)
    kinds = {s: sum(f["signal"] == s for f in chaos["faults"]) for s in ("SIGKILL", "SIGSTOP")}
    rows = [
        ("exit code (with faults / baseline)", f"{chaos['exit']} / {baseline['exit'] if baseline else '-'}"),
        ("test accuracy (with faults / baseline)",
         f"{chaos['metrics'].get('test_accuracy')} / {baseline['metrics'].get('test_accuracy') if baseline else '-'}"),
        ("faults", f"{len(chaos['faults'])} ({kinds['SIGKILL']} SIGKILL, {kinds['SIGSTOP']} SIGSTOP; "
                   f"process 0 {sum(f['process'] == 0 for f in chaos['faults'])} times)"),
        ("generations", f"{len(generations)}"),
        ("recovery, fault to next first step (s)",
         f"median {statistics.median(times):.1f}, max {max(times):.1f} ({len(times)} measured)" if times else "-"),
        *parts_rows(chaos),
        *change_rows(generations),
        ("steps run again", f"{again}"),
        ("goodput", f"{goodput['fraction']:.3f}" if goodput.get("fraction") is not None else "-"),
        ("goodput's parts (s)", ", ".join(f"{k} {v:.1f}" for k, v in goodput.get("seconds", {}).items() if v)),
        ("wall (s, with faults / baseline)", f"{chaos['wall']:.1f} / {baseline['wall']:.1f}" if baseline
         else f"{chaos['wall']:.1f} / -"),
        ("throughput ratio to the baseline", f"{baseline['wall'] / chaos['wall']:.2f}"
         if baseline and baseline["exit"] == chaos["exit"] == 0
         else "- (no baseline run)" if not baseline else "- (a run did not finish)"),
    ]
    return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def change_rows(generations: list[dict]) -> list[tuple[str, str]]:
    """The table's rows on the mesh changes the launcher recorded (metrics.json "generations":
    each one's `change`): count and seconds of each kind, in parts."""
    rows = []
    for kind in ("scale down", "scale up", "restart"):
        changes = [g["change"] for g in generations if g.get("change", {}).get("kind") == kind]
        if changes:
            total = {part: sum(c.get(part) or 0.0 for c in changes)
                     for part in ("stop", "restart", "restore", "reinitialisation", "wasted")}
            rows.append((f"{kind}s (launcher's record)", f"{len(changes)}: stop {total['stop']:.1f} s, "
                         f"restart {total['restart']:.1f} s (restore time {total['restore']:.1f} s, "
                         f"reinitialisation {total['reinitialisation']:.1f} s), "
                         f"wasted progress {total['wasted']:.1f} s"))
    return rows


def parts_rows(chaos: dict) -> list[tuple[str, str]]:
    """The table's rows on where the recoveries' time went (median seconds of each part)."""
    parts = [change_parts(f["at"], chaos.get("generations", [])) for f in chaos["faults"]]
    parts = [p for p in parts if p]
    if not parts:
        return []
    return [(f"of which {name} (median s)", f"{statistics.median(p[name] for p in parts):.1f}")
            for name in ("stop", "start", "first step")]


if __name__ == "__main__":
    sys.exit(main())
