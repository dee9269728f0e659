"""`meshfit launch`'s arguments and what it runs. meshfit.cli hands `launch` on to this module."""

from __future__ import annotations

import argparse

from meshfit.launch import local
from meshfit.errors import MeshfitError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`meshfit launch`'s flags, --elastic's among them."""
    parser.add_argument("--processes", type=int, metavar="N",
                        help="processes to start (with --via srun: default the allocation's tasks)")
    parser.add_argument("--devices-per-process", type=int, metavar="M",
                        help="simulated CPU devices per process (default: 1; --via srun: each task's "
                             "devices, for the records, default the command's --simulate-devices)")
    parser.add_argument("--port", type=int, metavar="P",
                        help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--show", choices=("all", "first"), default="all",
                        help="all: every process's lines, prefixed [i]; first: process 0's, "
                             "and a failed process's last lines (default: all)")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="stop the job after this many seconds (default: no limit)")
    parser.add_argument("--elastic", action="store_true",
                        help="when a process dies or hangs, restart `meshfit train` on the survivors "
                             "from its newest checkpoint (same global batch), until it finishes")
    parser.add_argument("--min-processes", type=int, default=1, metavar="N",
                        help="with --elastic: stop instead when fewer would be left (default: 1)")
    parser.add_argument("--max-restarts-without-progress", type=int, default=3, metavar="K",
                        help="with --elastic: stop once more than K restarts came in a row without "
                             "a newer checkpoint to resume from (default: 3; losses between saves "
                             "do not count, however many)")
    parser.add_argument("--no-grow", action="store_true", help="with --elastic: stay on the survivors "
                        "(default: lost processes start again at the next checkpoint)")
    parser.add_argument("--on-loss", choices=("restart", "shrink"), default="restart", help="with "
                        "--elastic: restart: a lost process starts again at once on its slot (the "
                        "same mesh), unless it is lost again before a step; shrink: go on without it "
                        "until the mesh grows back (default: restart)")
    parser.add_argument("--spares", type=int, metavar="N", help="with --elastic: processes started "
                        "ahead, imports done, that take a new generation's places (default: as many "
                        "as --processes; 0: none; not with --via srun)")
    parser.add_argument("--keep-batch", choices=("global", "per-core"), default="global", help="with "
                        "--elastic, on fewer devices: global: each takes a larger share of the batch; "
                        "per-core: each keeps its share, in micro-batches (default: global)")
    parser.add_argument("--via", choices=("local", "srun"), default="local", help="with --elastic: "
                        "local: processes of this machine; srun: each generation a step of the SLURM "
                        "allocation this runs in (default: local)")
    parser.add_argument("job_command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                        help="the command each process runs; a leading `meshfit` runs this meshfit")


def run(args: argparse.Namespace) -> int:
    """`meshfit launch`: one job (meshfit.launch.local), or with --elastic generations of them
    (meshfit.launch.elastic); the elastic flags without --elastic are a one-line error."""
    elastic_only = ("min_processes", "max_restarts_without_progress", "no_grow", "on_loss", "spares",
                    "keep_batch", "via")
    if args.elastic:
        from meshfit.launch import elastic  # start-up: only --elastic reads run directories

        if args.port:
            raise MeshfitError("--port goes without --elastic: each generation of an elastic job "
                               "takes a free port")
        return elastic.elastic_launch(args.job_command, args.processes, args.devices_per_process,
                                      grow=not args.no_grow, show=args.show, timeout=args.timeout,
                                      **{k: getattr(args, k) for k in elastic_only if k != "no_grow"})
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    if any(getattr(args, k) != defaults.get_default(k) for k in elastic_only):
        raise MeshfitError("--min-processes, --max-restarts-without-progress, --no-grow, --on-loss, "
                           "--spares, --keep-batch and --via go with --elastic")
    return local.launch(args.job_command, args.processes, args.devices_per_process or 1,
                        port=args.port, show=args.show, timeout=args.timeout)
