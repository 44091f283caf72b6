import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

# ----------------------------------------------------------------- subprocess timeouts as hang detectors
# A test's subprocess timeout detects a hang; it is no budget. Every wait on a subprocess with a timeout
# (subprocess.run, Popen.communicate, Popen.wait) is timed here, and the end of the run lists the ones
# closest to their timeout, with a warning for any that used more than a third of it: on a host 3x
# slower (an AVX2-only CPU under load) it would be killed. TRAINER_TEST_TIMINGS=path also writes them,
# and each test file's wall time, as JSON (what WALL_S below is made from).
MARGIN = 3
_records: list[dict] = []
_file_seconds: dict[str, float] = defaultdict(float)


def _timed(real):
    def call(self, *args, timeout=None, **kwargs):
        if timeout is None or getattr(self, "_trainer_timing", False):
            return real(self, *args, timeout=timeout, **kwargs)
        self._trainer_timing = True  # communicate() waits with what is left of the same timeout
        start = time.monotonic()
        try:
            return real(self, *args, timeout=timeout, **kwargs)
        finally:
            self._trainer_timing = False
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
            args0 = self.args if isinstance(self.args, list | tuple) else [self.args]
            what = " ".join(Path(str(a)).name for a in args0[:2])
            _records.append({"test": test, "what": what, "seconds": round(time.monotonic() - start, 1),
                             "timeout": timeout})  # fmt: skip

    return call


subprocess.Popen.communicate = _timed(subprocess.Popen.communicate)
subprocess.Popen.wait = _timed(subprocess.Popen.wait)


def pytest_runtest_logreport(report):
    if (
        not _worker
    ):  # on the controller (or plain pytest), which sees every worker's reports: each file's time
        _file_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the records to the controller
        session.config.workeroutput["trainer_subprocess_timings"] = json.dumps(_records)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _records.extend(json.loads(getattr(node, "workeroutput", {}).get("trainer_subprocess_timings", "[]")))


def pytest_terminal_summary(terminalreporter):
    if not _records or hasattr(terminalreporter.config, "workeroutput"):
        return
    write = terminalreporter.write_line
    ranked = sorted(_records, key=lambda r: -r["seconds"] / r["timeout"])
    terminalreporter.section("subprocess timeouts (hang detectors): the closest to their timeout")
    for r in ranked[:10]:
        write(
            f"{r['seconds']:7.1f} s of {r['timeout']:g} s ({r['seconds'] / r['timeout']:.0%})  {r['what']}  {r['test']}"
        )
    close = [r for r in ranked if r["seconds"] * MARGIN > r["timeout"]]
    if close:
        write(f"warning: {len(close)} subprocess wait(s) used more than 1/{MARGIN} of their timeout; a host "
              f"{MARGIN}x slower would time them out: raise the timeout (a hang detector, not a budget)")  # fmt: skip
    if path := os.environ.get("TRAINER_TEST_TIMINGS"):
        Path(path).write_text(json.dumps({"subprocesses": ranked, "files": dict(_file_seconds)}, indent=1))


_worker = False  # this process is a pytest-xdist worker (set in pytest_configure)


def pytest_configure(config):
    global _worker
    _worker = hasattr(config, "workerinput")
    # Rendezvous ports: each pytest-xdist worker, and every job it starts, chooses from its own share
    # of the range (TRAINER_PORTS), so that jobs of two workers never pick the same port.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        from trainer.cluster.dist import ENV_PORTS, port_range

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
    # file's time in a fresh clone's `bash .ci/run` on 2026-11-28 (3 workers on 2 cores, an AVX2-only
    # host, TRAINER_TEST_TIMINGS; 9,436 s of worker time); files not named (under 8 s each) come last.
    # Without this, xdist orders files by their number of tests: the Slurm test (one test, then 190 s)
    # started last and ran alone for its last 3 minutes.
    items.sort(key=lambda item: -WALL_S.get(item.nodeid.split("::")[0], 0))


WALL_S = {
    # issue 74's files, twice their time here (an AVX-512 host) until a CI run times them
    "tests/dist/test_reward_model.py": 150,
    "tests/e2e/test_reward_to_grpo.py": 130,
    "tests/unit/test_reward_trl.py": 110,
    "tests/unit/test_reward_config.py": 70,
    "tests/unit/test_rloo_trl.py": 50,
    # issue 72's files, twice their time here (an AVX-512 host) until a CI run times them
    "tests/dist/test_vision.py": 200,
    "tests/e2e/test_tiny_vlm.py": 160,
    "tests/unit/test_vision_data.py": 110,
    "tests/unit/test_vision_model.py": 55,
    "tests/dist/test_qlora_training.py": 626,
    "tests/e2e/test_tiny.py": 618,
    "tests/e2e/test_real_templates_train.py": 591,
    "tests/dist/test_lora.py": 571,
    "tests/dist/test_sequence_parallel.py": 503,
    "tests/dist/test_failfast.py": 484,
    "tests/dist/test_qlora.py": 450,
    "tests/dist/test_bf16_reshard.py": 416,
    "tests/dist/test_preference.py": 306,
    "tests/e2e/test_bad_input.py": 298,
    "tests/dist/test_stages.py": 286,
    "tests/dist/test_bench.py": 277,
    "tests/dist/test_finetune.py": 262,
    "tests/dist/test_grpo_training.py": 243,
    "tests/unit/test_grpo_plan.py": 218,
    "tests/dist/test_bf16_stages.py": 210,
    "tests/dist/test_resume_agreement.py": 197,
    "tests/e2e/test_lineage_cases.py": 171,
    "tests/dist/test_reshard.py": 169,
    "tests/dist/test_async_checkpoints.py": 151,
    "tests/e2e/test_resume_safety.py": 150,
    "tests/e2e/test_exports.py": 141,
    "tests/e2e/test_real_templates.py": 134,
    "tests/e2e/test_crash_points.py": 133,
    "tests/dist/test_step_memory.py": 131,
    "tests/e2e/test_lora_memory.py": 121,
    "tests/unit/test_lineage_crashes.py": 118,
    "tests/dist/test_kills.py": 114,
    "tests/dist/test_multinode.py": 98,
    "tests/dist/test_durability.py": 92,
    "tests/e2e/test_restarts.py": 83,
    "tests/dist/test_escalation.py": 76,
    "tests/e2e/test_damaged_files.py": 68,
    "tests/e2e/test_justification.py": 67,
    "tests/dist/test_slurm.py": 63,
    "tests/dist/test_elastic.py": 61,
    "tests/unit/test_dist.py": 49,
    "tests/e2e/test_global_batch.py": 48,
    "tests/unit/test_plan_matrix.py": 47,
    "tests/e2e/test_grpo_bad_input.py": 45,
    "tests/e2e/test_grpo_learns.py": 42,
    "tests/unit/test_docs.py": 36,
    "tests/e2e/test_checkpoint_interval.py": 36,
    "tests/unit/test_cache_key.py": 36,
    "tests/e2e/test_resume_errors.py": 35,
    "tests/unit/test_plan.py": 32,
    "tests/unit/test_packing_check.py": 31,
    "tests/e2e/test_startup.py": 29,
    "tests/dist/test_observability.py": 27,
    "tests/dist/test_family_matrix_ranks.py": 26,
    "tests/unit/test_sequence.py": 25,
    "tests/e2e/test_rollback.py": 24,
    "tests/e2e/test_grpo_trl_rewards.py": 17,
    "tests/unit/test_qlora_families.py": 15,
    "tests/unit/test_family_matrix.py": 14,
    "tests/unit/test_configs_hub.py": 14,
    "tests/unit/test_template_matrix.py": 13,
    "tests/unit/test_experts.py": 13,
    "tests/unit/test_grpo_stream.py": 10,
    "tests/unit/test_data.py": 9,
}
