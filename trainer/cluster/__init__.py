"""The processes of a job: where this process sits in it and what the launcher told it (`env`), the
process group, the collectives and the devices (`dist`), the one agreement of every step with its stop,
non-finite and save signals and the watchdog (`control`), and which nodes still answer after a failure
(`elastic`). What restarts the processes is the run's (`trainer/run/supervisor.py`)."""
