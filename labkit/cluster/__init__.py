"""The cluster (orchestration, rung 3): the Lab and its engine set, launchers and the watchdog,
GPU choice and the world setup, jobs, faults and their diagnosis, progress bars and magics."""
