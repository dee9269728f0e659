"""Where a traced train step's device time goes: a profiler trace (`meshfit train --profile`) summed
by kind of work and by kernel.

Reads every `*.xplane.pb` under DIR with `jax.profiler.ProfileData` (no TensorBoard needed) and,
for each accelerator plane (`/device:GPU:0`, `/device:TPU:0`, ...), sums the events of its
stream lines by kernel name. Prints the busy time of the traced span, the share of each kind of
work (convolutions, matrix products, XLA's fused elementwise/reduction kernels, copies and
transposes, host transfers) and the top kernels. With no accelerator plane (a CPU trace), the
host's XLA threads stand in, so the script can be tried anywhere.

    python benchmarks/xplane_ops.py RUN/tensorboard [--top 25] [--steps N] [--host N]

--steps: the number of traced steps, to print times per step. Also prints how much of the traced
span the device was busy (the union of its kernels' times), and with --host N the host's costliest
events outside Python (module loads, launches, waits).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
from collections import Counter

# Kernel-name patterns, first match wins. cuDNN's and CUTLASS' convolution kernels carry
# fprop/dgrad/wgrad or conv in their names; XLA's own kernels are named after the HLO fusion.
KINDS = (
    ("convolution", re.compile(r"conv|fprop|dgrad|wgrad|xmma_.*implicit|implicit_gemm|cudnn", re.I)),
    ("matrix product", re.compile(r"gemm|cublas|cutlass|matmul|triton_.*dot", re.I)),
    ("host transfer", re.compile(r"memcpy(htod|dtoh)|MemcpyH|MemcpyD2H|MemcpyH2D", re.I)),
    ("copy / transpose", re.compile(r"copy|transpose|memset|memcpy", re.I)),
    ("reduction fusion", re.compile(r"reduc", re.I)),
    ("elementwise fusion", re.compile(r"fusion|loop_|elementwise|convert|broadcast", re.I)),
)


def kind(name: str) -> str:
    """The kind of work a kernel name says (see KINDS), or 'other'."""
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def read_planes(trace_dir: str) -> list:
    """The planes of every trace under trace_dir (read once: a trace can be tens of MB)."""
    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not files:
        raise SystemExit(f"no *.xplane.pb under {trace_dir}; trace with meshfit train --profile START:STOP")
    return [plane for path in files for plane in ProfileData.from_file(path).planes]


def busy_and_span(intervals: list[tuple[int, int]]) -> tuple[int, int]:
    """(nanoseconds covered by at least one of the (start, end) intervals, from the first start
    to the last end): how much of the traced span the device was working."""
    busy, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            busy, reach = busy + end - start, end
        elif end > reach:
            busy, reach = busy + end - reach, end
    span = max(e for _, e in intervals) - min(s for s, _ in intervals) if intervals else 0
    return busy, span


def host_times(planes: list) -> Counter:
    """Nanoseconds by event name on the host planes, Python's own calls left out (the profiler
    names them "$file:line function"): the runtime's and the driver's work (loading modules,
    launching, waiting)."""
    times = Counter()
    for plane in planes:
        if not plane.name.startswith("/device:"):
            for line in plane.lines:
                for event in line.events:
                    if not event.name.startswith("$"):
                        times[event.name] += int(event.duration_ns)
    return times


def kernel_times(planes: list) -> tuple[Counter, Counter, str, list[tuple[int, int]]]:
    """(nanoseconds by kernel name, launches by kernel name, the planes read, each kernel's
    (start, end) in ns) over every accelerator plane's stream lines of a trace's planes."""
    times, counts, read, intervals = Counter(), Counter(), [], []
    devices = [p for p in planes if p.name.startswith("/device:")]
    for plane in devices or [p for p in planes if p.name == "/host:CPU"]:
        lines = list(plane.lines)
        # GPU planes also hold derived lines ("XLA Ops", "XLA Modules", "Steps") that restate
        # the streams' time: only the streams count, or XLA's ops where no stream line is
        # there (TPUs). On CPUs, XLA's threads.
        wanted = ("tf_XLA",) if not devices else \
            ("Stream",) if any(l.name.startswith("Stream") for l in lines) else ("XLA Ops",)
        for line in (l for l in lines if l.name.startswith(wanted)):
            for event in line.events:
                times[event.name] += int(event.duration_ns)
                counts[event.name] += 1
                intervals.append((int(event.start_ns), int(event.start_ns + event.duration_ns)))
        read.append(plane.name)
    return times, counts, ", ".join(sorted(set(read))), intervals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--steps", type=int, default=0, help="traced steps (for times per step)")
    parser.add_argument("--host", type=int, default=0, metavar="N",
                        help="also the N costliest kinds of host event (the runtime's, the driver's)")
    args = parser.parse_args()
    planes = read_planes(args.trace_dir)
    times, counts, read, intervals = kernel_times(planes)
    total = sum(times.values()) or 1
    per = f" per step (of {args.steps})" if args.steps else ""
    scale = 1 / args.steps if args.steps else 1.0
    print(f"planes: {read}; kernel time{per}: {total * scale / 1e6:.2f} ms, "
          f"{sum(counts.values()) * scale:.0f} launches")
    busy, span = busy_and_span(intervals)
    print(f"busy {busy / 1e6:.1f} ms of the {span / 1e6:.1f} ms from the first kernel to the last "
          f"({100 * busy / max(span, 1):.0f}%): the rest the device waited for the host")
    by_kind = Counter()
    for name, ns in times.items():
        by_kind[kind(name)] += ns
    print("| kind | ms | share |\n| --- | --- | --- |")
    for name, ns in by_kind.most_common():
        print(f"| {name} | {ns * scale / 1e6:.2f} | {100 * ns / total:.1f}% |")
    print(f"\n| kernel (top {args.top}) | kind | ms | launches | share |\n| --- | --- | --- | --- | --- |")
    for name, ns in times.most_common(args.top):
        print(f"| `{name[:90]}` | {kind(name)} | {ns * scale / 1e6:.3f} | {counts[name] * scale:.0f} | "
              f"{100 * ns / total:.1f}% |")
    if args.host:
        print(f"\n| host event (top {args.host}, all traced steps) | ms |\n| --- | --- |")
        for name, ns in host_times(planes).most_common(args.host):
            print(f"| `{name[:90]}` | {ns / 1e6:.1f} |")


if __name__ == "__main__":
    main()
