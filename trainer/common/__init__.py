"""The leaves every room stands on, knowing nothing of the run: user-facing errors and exit codes
(`errors`), sizes in bytes (`units`), atomic writes and locks (`files`), functions named by a dotted path
(`dotted`), a rank's imports without full collector passes (`startup`), DeepSpeed's patches
(`deepspeed_patches`), the faults the tests inject (`faults`) and the optimizers an experiment names
(`optimizers`)."""
