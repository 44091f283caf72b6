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
    # Longest files first (pytest-xdist --dist loadfile with --no-loadscope-reorder hands whole files
    # to the workers in this order, each taking the next when it runs low): the longest-processing-
    # time-first rule, so that no worker is left with a long file at the end. The seconds are each
    # file's wall time in the 2026-11-25 CI run (3 workers on 2 cores); files not named (unit tests,
    # seconds each) come last. Without this, xdist orders files by their number of tests: the
    # Slurm test (one test, then 190 s) started last and ran alone for its last 3 minutes.
    items.sort(key=lambda item: -WALL_S.get(item.nodeid.split("::")[0], 0))


WALL_S = {
    "tests/dist/test_lora.py": 283,
    "tests/dist/test_stages.py": 267,
    "tests/e2e/test_real_templates_train.py": 266,
    "tests/e2e/test_tiny.py": 221,
    "tests/dist/test_bf16_stages.py": 217,
    "tests/dist/test_failfast.py": 180,
    "tests/dist/test_finetune.py": 168,
    "tests/dist/test_preference.py": 163,
    "tests/dist/test_sequence_parallel.py": 149,
    "tests/dist/test_resume_agreement.py": 122,
    "tests/dist/test_async_checkpoints.py": 122,
    "tests/dist/test_bf16_reshard.py": 121,
    "tests/e2e/test_bad_input.py": 93,
    "tests/dist/test_reshard.py": 91,
    "tests/dist/test_bench.py": 100,
    "tests/dist/test_kills.py": 76,
    "tests/dist/test_step_memory.py": 74,
    "tests/e2e/test_resume_safety.py": 58,
    "tests/e2e/test_real_templates.py": 56,
    "tests/dist/test_elastic.py": 51,
    "tests/dist/test_escalation.py": 50,
    "tests/e2e/test_restarts.py": 46,
    "tests/e2e/test_justification.py": 42,
    "tests/dist/test_slurm.py": 35,
    "tests/dist/test_multinode.py": 32,
    "tests/unit/test_dist.py": 22,
    "tests/dist/test_observability.py": 20,
    "tests/e2e/test_resume_errors.py": 18,
    "tests/e2e/test_checkpoint_interval.py": 12,
}
