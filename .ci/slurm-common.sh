# Sourced by .ci/slurm-up.sh and .ci/slurm-2node-up.sh: the slurm.conf settings both clusters share (daemons as
# root, munge, no cgroups or accounting, and the timings that make a requeue quick), so that they cannot drift apart.
slurm_common_conf() {
  cat <<'CONF'
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits cred_expire + 1 s (default 120) for its old credential to expire; 5 is Slurm's minimum
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmctldTimeout=10
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=10
Waittime=0
# the main scheduling loop every second (default 60): a requeued job starts once its wait is over, not up to a
# minute later (no event wakes the scheduler when a begin time passes)
SchedulerParameters=batch_sched_delay=0,sched_interval=1
CONF
}
