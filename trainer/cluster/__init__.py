"""The processes of a job: where this process sits in it (the launcher's environment), its process group,
small collectives and seeds (`dist`), the devices it may use, found without initialising CUDA (`devices`),
the one agreement of every step with its stop, non-finite and save signals and the watchdog (`control`),
and which nodes still answer after a failure (`elastic`). What restarts the processes is the run's
(`trainer/run/supervisor.py`)."""
