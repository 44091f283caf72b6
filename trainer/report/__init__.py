"""`bin/report`: a run's curves and summary from its run directory (`runs`), and runs of one job at
several sizes compared (`compare`); `cli` parses its arguments."""
