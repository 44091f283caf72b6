import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config):
    # Rendezvous ports: each pytest-xdist worker, and every job it starts, chooses from its own share
    # of the range (TRAINER_PORTS), so that jobs of two workers never pick the same port.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        from trainer.dist import ENV_PORTS, port_range

        lo, hi = port_range()
        n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
        share = (hi - lo) // n
        first = lo + int(worker.removeprefix("gw")) % n * share
        os.environ[ENV_PORTS] = f"{first}-{first + share - 1}"


def pytest_collection_modifyitems(config, items):
    import shutil

    has_gpu = shutil.which("nvidia-smi") is not None
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
