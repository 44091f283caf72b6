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
    # The longest files first, so that pytest-xdist (--dist loadfile, whole files in collection order)
    # starts them at once and the short ones fill the gaps at the end (CI's wall time is the slowest
    # worker's: these two started last in the 2026-11-25 run, 933 s).
    first = ("tests/e2e/test_tiny.py", "tests/e2e/test_real_templates_train.py")
    items.sort(
        key=lambda item: next((i for i, f in enumerate(first) if item.nodeid.startswith(f)), len(first))
    )
