#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for meshfit's tests and for trying tools/slurm/train.sbatch.
#
#   tools/slurm/up.sh [DIR]     # then: export SLURM_CONF=DIR/slurm.conf; sbatch ...; tools/slurm/down.sh DIR
#
# Everything lives in DIR (default: a new folder under /tmp): the slurm.conf it writes, a munge key
# and munged's socket, slurmctld's state, slurmd's spool, the logs and the daemons' pid files. Free
# ports are chosen, so two such clusters (two test runs) can run side by side and nothing in
# /etc/slurm or /etc/munge is used or changed. One node, named after this host, of CPUS (default
# 8) CPUs whatever the machine has (SlurmdParameters=config_overrides): 2 tasks, or a requeued job
# beside another one, fit on a 2-core machine. One partition, "meshfit", the default.
# Needs root (slurmd starts jobs as their user) and Debian's packages: apt-get install slurm-wlm munge.
# Prints the DIR on stdout once the node is idle; on failure a one-line reason on stderr, exit 1.
set -euo pipefail

fail() { echo "tools/slurm/up.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (slurmd starts jobs as their user); run it with sudo"
for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || fail "$tool not found; install it: apt-get install slurm-wlm munge"
done

DIR=${1:-$(mktemp -d /tmp/meshfit-slurm-XXXXXX)}
mkdir -p "$DIR"/state "$DIR"/spool
chmod 711 "$DIR"  # munged wants its socket folder searchable by all
DIR=$(cd "$DIR" && pwd)
CPUS=${CPUS:-8}

free_ports() {  # $1 free TCP ports, on one line
    python3 -c 'import socket, sys
s = [socket.socket() for _ in range(int(sys.argv[1]))]
for x in s: x.bind(("", 0))
print(*(x.getsockname()[1] for x in s))' "$1"
}
read -r CTLD_PORT SLURMD_PORT < <(free_ports 2)
NODE=$(hostname -s)
getent hosts "$NODE" >/dev/null || NODE=localhost  # jobs reach their first node by this name
# JAX's SLURM detection puts the coordinator on port 61440 + job id % 4096: random job ids keep two
# clusters' jobs on this machine apart.
FIRST_JOB_ID=$(( (RANDOM * 32768 + RANDOM) % 1000000 + 1000 ))

cat > "$DIR/slurm.conf" <<EOF
# Written by meshfit's tools/slurm/up.sh: a one-node cluster whose files are all in $DIR.
ClusterName=meshfit
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
# a requeued job may start again cred_expire seconds after its requeue (SLURM's default: 120)
AuthInfo=socket=$DIR/munge.socket,cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# a job's processes are its tasks' process groups (no cgroups needed; proctrack/linuxproc, which
# walks /proc, listed every process of this machine as a batch step's)
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
# pending jobs (a requeued one) are looked at every 2 s (SLURM's default: 60)
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobRequeue=1
FirstJobId=$FIRST_JOB_ID
# seconds between a job's SIGTERM (time limit, scancel) and its SIGKILL (SLURM's default: 30)
KillWait=30
MinJobAge=600
InactiveLimit=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=meshfit Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF

# munge authenticates slurm's messages: a key and a daemon of this cluster's own.
[ -f "$DIR/munge.key" ] || { dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none; }
chmod 400 "$DIR/munge.key"
out=$(munged --key-file="$DIR/munge.key" --socket="$DIR/munge.socket" --pid-file="$DIR/munged.pid" \
    --log-file="$DIR/munged.log" --seed-file="$DIR/munged.seed" 2>&1) \
    || fail "munged did not start: ${out//$'\n'/ }"

export SLURM_CONF=$DIR/slurm.conf
out=$(slurmctld -f "$SLURM_CONF" 2>&1) || fail "slurmctld did not start: ${out//$'\n'/ } (see $DIR/slurmctld.log)"
out=$(slurmd -f "$SLURM_CONF" -N "$NODE" 2>&1) || fail "slurmd did not start: ${out//$'\n'/ } (see $DIR/slurmd.log)"

for _ in $(seq 300); do  # at most 30 s for the node to register
    state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
    [ "$state" = idle ] && { echo "$DIR"; exit 0; }
    sleep 0.1
done
fail "node $NODE is not idle after 30 s (state: ${state:-unknown}); see $DIR/slurmctld.log and $DIR/slurmd.log"
