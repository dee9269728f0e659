#!/usr/bin/env bash
# Stop the one-node SLURM cluster that tools/slurm/up.sh started in DIR, and remove DIR.
#
#   tools/slurm/down.sh DIR [--keep]    # --keep: leave DIR (its logs) in place
#
# Cancels the cluster's jobs, then ends its daemons by the pids in their pid files: SIGTERM,
# SIGKILL after 10 s; then any process of its jobs still left.
set -uo pipefail

DIR=${1:?usage: tools/slurm/down.sh DIR [--keep]}
[ -f "$DIR/slurm.conf" ] || { echo "tools/slurm/down.sh: $DIR/slurm.conf not found: no cluster there" >&2; exit 1; }
export SLURM_CONF=$DIR/slurm.conf

if [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
    scancel --full --signal=KILL "--partition=meshfit" 2>/dev/null
    scancel --partition=meshfit 2>/dev/null
    for _ in $(seq 100); do  # at most 10 s for the jobs' processes to end
        [ -z "$(squeue -h -t R,CG 2>/dev/null)" ] && break
        sleep 0.1
    done
fi

pids=()
for daemon in slurmd slurmctld munged; do
    pid=$(cat "$DIR/$daemon.pid" 2>/dev/null) || continue
    kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
done
for _ in $(seq 100); do
    alive=()
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
    [ ${#alive[@]} = 0 ] && break
    sleep 0.1
done
for pid in "${alive[@]}"; do kill -KILL "$pid" 2>/dev/null; done

# Anything of the cluster's jobs still left (a slurmstepd of a job on a node set DOWN outlives
# the daemons): processes whose environment names this cluster's slurm.conf and that are a
# slurmstepd or part of a job.
for proc in /proc/[0-9]*; do
    pid=${proc#/proc/}
    [ "$pid" = $$ ] && continue
    variables=$({ tr '\0' '\n' < "$proc/environ"; } 2>/dev/null) || continue
    grep -qx "SLURM_CONF=$DIR/slurm.conf" <<<"$variables" || continue
    if [ "$(cat "$proc/comm" 2>/dev/null)" = slurmstepd ] || grep -q '^SLURM_JOB_ID=' <<<"$variables"; then
        kill -KILL "$pid" 2>/dev/null
    fi
done

[ "${2:-}" = --keep ] || rm -rf "$DIR"
