"""The generations of `meshfit launch --elastic --via srun`: job steps of a SLURM allocation.

    sbatch --no-kill --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 tools/slurm/elastic.sbatch \\
        -- meshfit train cifar10-cnn --out /shared/runs/c10

Inside an allocation (sbatch or salloc: SLURM_JOB_ID set) the elastic launcher
(meshfit.launch.elastic, its generation loop unchanged) runs each generation as one step,
`srun --ntasks=N --nodes=1-K --kill-on-bad-exit=0 --label [--exclude=NODES] meshfit train ...`:
SLURM starts the tasks and JAX's SLURM detection joins them (meshfit.parallel.cluster). The
launcher learns of the step what `meshfit launch` learns of its own processes, so that
local.run_job (watchdog, stops, Ended) and the loop's lost_processes decide as they do locally:
- each task's exit: srun prints a line as a task ends non-zero ("srun: error: NODE: task 1:
  Killed", "...: tasks 0-1: Exited with exit code 143"); a task it names in none exited 0;
- joining, progress and each task's node: the status files the tasks write into a folder beside
  the run directory (MESHFIT_LAUNCH_STATUS, meshfit.parallel.heartbeat), on storage every node
  reads as the run directory is;
- a lost node: one srun reports failed ("Node failure on NODE"), or a lost task's node that is
  down or no longer in the allocation (scontrol, sinfo) once the step ended.
The launcher stops a step as it stops its processes: SIGTERM through `scancel --signal=TERM
JOB.STEP` (every task at once, once: the agreed save), SIGKILL by SIGTERM to srun (which kills
the step: "forcing job termination"). --kill-on-bad-exit=0: after an agreed stop the tasks exit
143 one after the other, and none may be killed as the first exits (the launcher stops the others
itself, as launch does). Submit with --no-kill, or SLURM ends the whole allocation with a node.

What is lost, and what comes back: a task killed on a node that is up (SIGKILL, a crash) is one
process fewer for the next generation, on the same nodes, and its slot is used again at the next
checkpoint (as locally). A lost node's tasks are fewer too, and the node is left out of the next
steps (--exclude while it is still in the allocation). With --no-kill SLURM takes a failed node
out of the allocation, and an allocation never grows, so its tasks do not come back: the mesh
grows back to what the allocation has left. A lost node that is up in the allocation again when
a checkpoint is committed (set DOWN and RESUMEd) counts again.
"""

from __future__ import annotations

import collections
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from typing import Callable, IO

from meshfit import env
from meshfit.launch import local
from meshfit.launch.output import Output
from meshfit.launch.process import proc_state
from meshfit.errors import MeshfitError
from meshfit.parallel import heartbeat

# srun's lines (src/srun: a task's end, printed as it comes; a node it lost), its --label prefix
TASK_END = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,-]+): (?P<how>.+)$")
NODE_FAILURE = re.compile(r"^srun: error: Node failure on (?P<nodes>\S+)")
LABELED = re.compile(r"^\s*(\d+): ?(.*)$")
# srun's lines about a step the launcher stops: its own line names that
NOISE = re.compile(r"^srun: (forcing job termination|Job step aborted|Force Terminated|Terminating|"
                   r"error: Timed out waiting for job step)|\*\*\* STEP \S+ ON \S+ CANCELLED")
USABLE_STATES = ("alloc", "mix", "idle", "comp")  # sinfo %t of a node a step may use


def task_numbers(text: str) -> list[int]:
    """srun's task list as numbers: '0-2,5' -> [0, 1, 2, 5]."""
    found = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        found += range(int(first), int(last or first) + 1)
    return found


def exit_code(how: str) -> int | None:
    """A Popen return code for srun's words on a task's end: 'Exited with exit code 3' -> 3,
    'Killed' -> -9, 'Aborted (core dumped)' -> -6 (strsignal's words); None for others."""
    words = how.removesuffix(" (core dumped)").strip()
    exited = re.fullmatch(r"Exited with exit code (\d+)", words)
    if exited:
        return int(exited.group(1))
    for signum in signal.Signals:
        if signal.strsignal(signum) == words:
            return -signum
    return None


def hostnames(nodelist: str) -> list[str]:
    """A SLURM node list as names, 'n[1-2],m' -> ['n1', 'n2', 'm'] (scontrol; as given when it
    cannot)."""
    try:
        return _slurm("scontrol", "show", "hostnames", nodelist).split()
    except MeshfitError:
        return nodelist.split(",")


def allocation_nodes(job: str) -> list[str]:
    """The nodes the allocation `job` holds now (scontrol: a node that failed under --no-kill has
    left it)."""
    fields = dict(f.split("=", 1) for f in _slurm("scontrol", "show", "job", "--oneliner", job).split()
                  if "=" in f)
    nodelist = fields.get("NodeList", "")
    return hostnames(nodelist) if nodelist and nodelist != "(null)" else []


def usable(nodes: list[str]) -> set[str]:
    """Those of `nodes` that are up (sinfo: allocated, mixed, idle; not down, drained, failing or
    not responding)."""
    if not nodes:
        return set()
    states = _slurm("sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t").splitlines()
    return {node for node, state in (line.split() for line in states if len(line.split()) == 2)
            if state.startswith(USABLE_STATES) and not state.endswith(("*", "~", "#", "!", "%", "$", "@"))}


def _slurm(*command: str) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MeshfitError(f"`{' '.join(command)}` failed ({e}); is SLURM's client installed and "
                           "its controller up?") from None
    if done.returncode:
        raise MeshfitError(f"`{' '.join(command)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout.strip()


def srun_command(count: int, name: str, nodes: list[str], lost: set[str]) -> list[str]:
    """The srun line of a generation of `count` tasks in an allocation of `nodes` (as it holds
    them now), leaving out the `lost` nodes that are still in it. --nodes: srun would take the
    allocation's node count from SLURM_NNODES, which a lost node leaves too high."""
    exclude = sorted(lost & set(nodes))
    spread = max(min(len(nodes) - len(exclude), count), 1)
    return ["srun", f"--ntasks={count}", f"--nodes=1-{spread}", "--kill-on-bad-exit=0", "--label",
            "--export=ALL", f"--job-name={name}", *([f"--exclude={','.join(exclude)}"] if exclude else [])]


class Srun:
    """meshfit.launch.elastic's runner inside a SLURM allocation: one srun step a generation
    (see the module). tasks: the allocation's tasks (SLURM_NTASKS), the default --processes."""

    def __init__(self, run: str):
        self.job = os.environ.get("SLURM_JOB_ID", "").strip()
        if not self.job:
            raise MeshfitError("--via srun runs inside a SLURM allocation (SLURM_JOB_ID is not set); "
                               "put the launch line in a batch script (sbatch --no-kill) or salloc")
        if shutil.which("srun") is None:
            raise MeshfitError("--via srun: srun not found on the PATH; run the launch where "
                               "SLURM's commands are installed")
        self.tasks = env.read_int("SLURM_NTASKS") or 1
        self.run, self.generation = run, 0
        self.lost_nodes: dict[str, int] = {}  # node -> tasks lost with it, while it is not back

    def most(self, processes: int) -> int:
        """The processes a generation can have now: `processes` but the tasks of lost nodes that
        are not up in the allocation again."""
        if self.lost_nodes:
            back = usable(allocation_nodes(self.job)) & set(self.lost_nodes)
            for node in back:
                del self.lost_nodes[node]
        return max(processes - sum(self.lost_nodes.values()), 0)

    def note_lost(self, ended: local.Ended, lost: list[int]) -> None:
        """Remember the nodes of the `lost` tasks that srun reported failed or that are down or
        gone from the allocation now (a task lost on a node that is up was a crash)."""
        on = {i: getattr(task, "node", None) for i, task in enumerate(ended.started)}
        nodes = {on[i] for i in lost if on.get(i)}
        if not nodes:
            return
        failed = set().union(*(getattr(task, "failed_nodes", set()) for task in ended.started[:1]))
        up = usable(allocation_nodes(self.job))
        for node in nodes:
            if node in failed or node not in up:
                self.lost_nodes[node] = sum(1 for i in on if on[i] == node)

    def close(self) -> None:
        """What the runner keeps between generations: nothing (srun starts each step's tasks)."""

    def resume_point(self, run: str) -> str | None:
        """The checkpoint the next step resumes from: not known here (each node's local copies
        are its own, meshfit.run.local_copies), None."""
        return None

    def __call__(self, argv: list[str], count: int, devices_per_process: int, show: str,
                 timeout: float | None, grace: float,
                 boundary: Callable[[], bool] | None, output: Output | None = None) -> local.Ended:
        """One generation: `count` tasks of `argv` as an srun step; how it ended (local.Ended)."""
        self.generation += 1
        name = f"meshfit-generation-{self.generation}"  # scancel finds the step by it
        srun = srun_command(count, name, allocation_nodes(self.job), set(self.lost_nodes))
        parent = os.path.dirname(os.path.abspath(self.run))
        os.makedirs(parent, exist_ok=True)

        def start(started, argv, processes, status, show, exits, output):
            Step(started, srun, argv, processes, status, show, exits, self.job, name, output)

        return local.run_job(argv, count, devices_per_process, None, show, timeout, grace,
                             boundary, start=start, status_in=parent, output=output)


class Step:
    """One srun step whose tasks stand in `started` for launch's processes: each a `Task`."""

    def __init__(self, started: list, srun: list[str], argv: list[str], processes: int, status: str,
                 show: str, exits: queue.Queue, job: str, name: str, output: Output):
        self.job, self.name, self.status, self.output = job, name, status, output
        self.show, self.exits = show, exits
        self.signalled: set[int] = set()
        self.failed_nodes: set[str] = set()
        self.lock = threading.Lock()
        variables = dict(os.environ)
        variables.update({env.LAUNCH_STATUS: status, "PYTHONUNBUFFERED": "1"})
        variables.setdefault(env.INIT_TIMEOUT, str(local.INIT_TIMEOUT_SECONDS))
        try:
            self.srun = subprocess.Popen([*srun, *argv], env=variables, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as e:
            raise MeshfitError(f"cannot start srun ({e.strerror})") from None
        self.pumps = [threading.Thread(target=self._pump, args=(stream, out), daemon=True)
                      for stream, out in ((self.srun.stdout, sys.stdout), (self.srun.stderr, sys.stderr))]
        self.tasks = [Task(i, self) for i in range(processes)]
        started.extend(self.tasks)
        for pump in self.pumps:
            pump.start()
        threading.Thread(target=self._reap, daemon=True).start()
        print(f"meshfit launch: {processes} task(s) as a step of SLURM job {job}: {' '.join(srun)} ...",
              file=sys.stderr, flush=True)

    def _pump(self, stream: IO[bytes], out: IO[str]) -> None:
        for raw in iter(stream.readline, b""):
            self.line(raw.decode(errors="replace").rstrip("\r\n"), out)

    def line(self, line: str, out: IO[str]) -> None:
        """Route one line of srun's: a task's (its tail, shown as launch shows it), a task's end
        or a lost node (its exit), or srun's own (shown, but for the noise of a stop)."""
        labeled = LABELED.match(line)
        if labeled and int(labeled.group(1)) < len(self.tasks):
            index, text = int(labeled.group(1)), labeled.group(2)
            self.tasks[index].tail.append(text)
            if index == 0 and self.output.condensed(text, lambda t: self.line(f"0: {t}", out)):
                return
            if local.GLOO_CONNECTED.match(text) or NOISE.search(text) or \
                    (self.show == "first" and index != 0) or not self.output.shown(index, text):
                return
            text = f"[{index}] {text}" if self.show == "all" else text
        else:
            ended, failure = TASK_END.match(line), NODE_FAILURE.match(line)
            if ended:
                code = exit_code(ended.group("how"))
                for index in task_numbers(ended.group("tasks")):
                    if index < len(self.tasks):
                        self.tasks[index].node = self.tasks[index].node or ended.group("node")
                        self.end(index, -signal.SIGKILL if code is None else code)
                return
            if failure:  # the tasks of those nodes, as far as their join markers say
                self.failed_nodes.update(hostnames(failure.group("nodes")))
                for index, node in heartbeat.nodes(self.status).items():
                    if node in self.failed_nodes and index < len(self.tasks):
                        self.end(index, -signal.SIGKILL)
            if NOISE.search(line):
                return
            text = line
        with self.lock:
            out.write(text + "\n")
            out.flush()

    def end(self, index: int, code: int) -> None:
        """Task `index` ended with `code` (its first word counts)."""
        task = self.tasks[index]
        with self.lock:
            if task.returncode is not None:
                return
            task.returncode = code
        task.node = task.node or heartbeat.nodes(self.status).get(index)
        task.ended.set()
        self.exits.put((index, code))

    def _reap(self) -> None:
        """Once srun ended: the tasks it named no end for exited 0 (it prints none for those),
        or with srun's own code when it ran none (srun itself failed: a bad option, no room)."""
        code = self.srun.wait()
        for pump in self.pumps:
            pump.join()
        ran = bool(heartbeat.joined(self.status)) or any(t.tail or t.returncode is not None
                                                         for t in self.tasks)
        nodes = heartbeat.nodes(self.status)
        for task in self.tasks:
            task.node = task.node or nodes.get(task.index)
            killed = signal.SIGKILL in self.signalled
            self.end(task.index, 0 if ran and not killed else -signal.SIGKILL if killed else code)

    def signal(self, signum: int) -> None:
        """Send `signum` to every task once: SIGKILL as SIGTERM to srun (it kills the step), others
        by scancel (srun would take SIGTERM for a kill too)."""
        with self.lock:
            if signum in self.signalled or self.srun.returncode is not None:
                return
            self.signalled.add(signum)
            if signum == signal.SIGKILL:
                for task in self.tasks:
                    task.killed = task.killed or task.returncode is None
        if signum == signal.SIGKILL:
            self.srun.send_signal(signal.SIGTERM)
            return
        steps = subprocess.run(["squeue", "-h", "-s", "-j", self.job, "-o", "%i %j"],
                               capture_output=True, text=True, timeout=60).stdout.split("\n")
        ids = [line.split()[0] for line in steps if line.split()[1:] == [self.name]]
        if ids:
            subprocess.run(["scancel", f"--signal={signal.Signals(signum).name.removeprefix('SIG')}",
                            *ids], capture_output=True, timeout=60)
        elif signum == signal.SIGTERM:  # no step yet (srun still starting it): no save to wait for
            self.signal(signal.SIGKILL)


def _holds(pid: int, status: str) -> bool:
    """Whether process `pid` of this machine runs with MESHFIT_LAUNCH_STATUS=status."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{env.LAUNCH_STATUS}={status}".encode() in f.read().split(b"\0")
    except OSError:
        return False


class Task:
    """A task of a `Step`, as launch's processes are used: its exit, last lines and node. It is
    its own `popen` (returncode, poll, wait), so launch's stops and waits take it as they are."""

    def __init__(self, index: int, step: Step):
        self.index, self.step, self.output = index, step, step.output
        self.killed = False  # the launcher killed the step while it ran
        self.tail: collections.deque[str] = collections.deque(maxlen=local.KEPT_LINES)
        self.pumps = step.pumps
        self.popen = self
        self.returncode: int | None = None
        self.node: str | None = None
        self.failed_nodes = step.failed_nodes
        self.ended = threading.Event()
        self.pid: int | None = None  # on the launcher's node, once the task has started joining
        self.elsewhere = False  # its joining marker names another node

    def poll(self) -> int | None:
        return self.returncode

    def state(self) -> str | None:
        """The task's state letter in /proc (T: SIGSTOPped) where it runs on the launcher's node,
        so that the watchdog loses a frozen task there in FROZEN_SECONDS as launch does
        (watchdog.frozen), not after JAX's heartbeat timeout; None for a task on another node,
        where the heartbeat is the check. Its pid comes from its joining marker, taken only if
        that process holds this step's status folder (a pid is not reused by another task). Each
        poll reads at most this task's own marker, and none once it named another node."""
        if self.pid is None:
            if self.elsewhere:
                return None
            node, pid = heartbeat.joining_marker(self.step.status, self.index) or (None, None)
            self.elsewhere = node is not None and node != heartbeat.this_node()
            if pid is None or self.elsewhere or not _holds(pid, self.step.status):
                return None
            self.pid = pid
        return proc_state(self.pid)

    def failed(self) -> bool:
        """Whether srun reported the task's end with an error or a signal (meshfit.launch.output)."""
        return self.returncode not in (None, 0)

    def wait(self, timeout: float | None = None) -> int:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired("srun", timeout)
        return self.returncode

    def signal(self, signum: int) -> None:
        self.step.signal(signum)
