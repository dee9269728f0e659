"""Sum a run's XLA compilations from its JAX_LOG_COMPILES log: how many, how long, which.

JAX_LOG_COMPILES=1 makes JAX log "Finished XLA compilation of jit(NAME) in S sec" for each program
it compiles or loads from its persistent cache ("Persistent compilation cache hit for 'jit_NAME'"
just before). Prints the count and seconds of both kinds, then the programs by seconds summed over
their compilations, the costliest first.

Usage: JAX_LOG_COMPILES=1 meshfit train ... 2> compiles.log
       python benchmarks/compile_log.py compiles.log [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import re

FINISHED = re.compile(r"Finished XLA compilation of (.+) in ([0-9.eE+-]+) sec")
HIT = "Persistent compilation cache hit"


def compilations(lines) -> list[tuple[str, float, bool]]:
    """(program, seconds, loaded from the persistent cache) for each compilation in the log."""
    found, hit = [], False
    for line in lines:
        if HIT in line:
            hit = True
        match = FINISHED.search(line)
        if match:
            found.append((match.group(1), float(match.group(2)), hit))
            hit = False
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    with open(args.log, errors="replace") as f:
        found = compilations(f)
    for label, cached in (("compiled", False), ("loaded from the cache", True)):
        seconds = [s for _, s, hit in found if hit == cached]
        print(f"{label}: {len(seconds)} programs, {sum(seconds):.2f} s")
    by_program = collections.defaultdict(lambda: [0, 0.0, 0])
    for name, seconds, hit in found:
        entry = by_program[name]
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + seconds, entry[2] + hit
    print(f"{'seconds':>8} {'count':>5} {'hits':>4}  program")
    for name, (count, seconds, hits) in sorted(by_program.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"{seconds:8.3f} {count:5d} {hits:4d}  {name}")


if __name__ == "__main__":
    main()
