#!/usr/bin/env bash
# A single-host Slurm cluster for trying and testing bertrain's Slurm path: munged + slurmctld + slurmd, one node
# (this host) with 2 CPUs, one partition. Needs root and Debian's `slurm-wlm` and `munge` packages
# (apt-get install -y slurm-wlm munge). Everything lives under STATE_DIR; nothing in /etc is changed.
#
#   examples/slurm/local-cluster.sh start [STATE_DIR]   # prints: export SLURM_CONF=STATE_DIR/slurm.conf
#   examples/slurm/local-cluster.sh stop  [STATE_DIR]
#
# Then, with SLURM_CONF exported: `srun -n 2 bertrain pretrain ...`, `sbatch examples/slurm/pretrain.sbatch`.
set -euo pipefail
cmd=${1:?usage: local-cluster.sh start|stop [STATE_DIR]}
state=$(realpath -m "${2:-/tmp/bertrain-slurm}")
# the node's name is what srun's tasks get as the master's host name (SLURM_STEP_NODELIST): it must resolve
node=$(hostname -s)
getent hosts "$node" >/dev/null || node=localhost

stop() {
    for daemon in slurmd slurmctld; do
        if [[ -f $state/$daemon.pid ]]; then kill "$(cat "$state/$daemon.pid")" 2>/dev/null || true; fi
    done
    if [[ -f $state/munged.pid ]]; then kill "$(cat "$state/munged.pid")" 2>/dev/null || true; fi
    sleep 1
    rm -f "$state"/*.pid
}

if [[ $cmd == stop ]]; then stop; exit 0; fi
[[ $cmd == start ]] || { echo "usage: local-cluster.sh start|stop [STATE_DIR]" >&2; exit 2; }
for tool in munged slurmctld slurmd srun sbatch scontrol; do
    command -v "$tool" >/dev/null || { echo "$tool not found: apt-get install -y slurm-wlm munge" >&2; exit 2; }
done
[[ $(id -u) == 0 ]] || { echo "local-cluster.sh runs the daemons as root: run it as root" >&2; exit 2; }
stop
mkdir -p "$state"/{ctld,spool,munge}
chmod 700 "$state/munge"

# munge: a fresh key for this cluster only; its socket in the state folder (slurm.conf's AuthInfo points at it)
dd if=/dev/urandom bs=1 count=1024 of="$state/munge/munge.key" status=none
chmod 400 "$state/munge/munge.key"
munged --force --key-file "$state/munge/munge.key" --socket "$state/munge/munge.socket" \
    --pid-file "$state/munged.pid" --log-file "$state/munged.log" --seed-file "$state/munge/munge.seed"

cat > "$state/slurm.conf" <<CONF
ClusterName=bertrain-local
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$state/munge/munge.socket
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
# no cgroups: containers rarely allow them, and a test cluster needs no confinement
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# take the node's CPUs from this file, not from the hardware: the same 2-CPU node on any machine
SlurmdParameters=config_overrides
NodeName=$node NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$state/slurm.conf
slurmctld -i
slurmd -N "$node"
# wait until the node is up and idle (slurmd registered)
for _ in $(seq 60); do
    if sinfo -h -o %t 2>/dev/null | grep -qx idle; then echo "export SLURM_CONF=$SLURM_CONF"; exit 0; fi
    sleep 1
done
echo "the local Slurm node did not come up; logs: $state/slurmctld.log $state/slurmd.log" >&2
sinfo >&2 || true
exit 1
