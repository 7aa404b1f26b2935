"""The daemon, in wings; ARCHITECTURE.md draws them, tests/unit/test_layering.py holds them.

* :mod:`jaild.daemon.core` -- pure decisions, no IO: admission, the job machine, the tool
  broker, how a job ended, the records, who a peer is.
* :mod:`jaild.daemon.jails` -- making and driving jails: the job driver, the launchers
  (nsjail per job, a zygote's fork), warm pools, cgroups, the runtime's staged copy.
* :mod:`jaild.daemon.egress.service` -- the egress gateway: one door per jail, its service, its CA.
* :mod:`jaild.daemon.observe` -- what is seen of it: metrics, audit, usage accounting.
* the shell, here: the server (connections), start-up and tear-down, the pipeline from a
  request to its record, sessions, placement, the registry, configuration, systemd.

No wing imports the shell; the core imports no other wing.
"""
