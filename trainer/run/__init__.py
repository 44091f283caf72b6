"""What `bin/train` does, from its arguments to its exit, in the order a run takes the modules:
`cli` (the arguments and their dispatch) -> `commands` (--plan, --prepare-data, --preview-data,
supervise, train) -> `plan` (the model's size, the strategy, the DeepSpeed JSON) -> `build` (claim
the run directory with `rundir`, agree at start with `consistency`, the data, `build_model`'s model and
engine -> `Run`) -> `modes` (train or a one-off mode, over `attempt`'s life cycle, `banner` at start,
`profile`) -> `loop` (the steps). `supervisor` is `bin/train --launcher`: it starts the launcher and
restarts it."""
