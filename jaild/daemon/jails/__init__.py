"""Making and driving jails: the job driver (job), what a run measures (run_account), the
launchers (launch/: nsjail per job, a zygote's fork), warm pools (pool), the cgroup subtree
(cgroups), the runtime's staged copy (staging), seccomp kill records (kernlog)."""
