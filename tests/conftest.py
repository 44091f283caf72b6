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
    # file's time in a fresh clone's `bash .ci/run` on 2026-11-30 (3 workers on 2 cores, TRAINER_TEST_TIMINGS;
    # 10,449 s of worker time); files not named (under 8 s each) come last.
    # Without this, xdist orders files by their number of tests: the Slurm test (one test, then 190 s)
    # started last and ran alone for its last 3 minutes.
    items.sort(key=lambda item: -WALL_S.get(item.nodeid.split("::")[0], 0))


WALL_S = {
    "tests/e2e/test_tiny.py": 665,
    "tests/dist/test_vision.py": 578,
    "tests/unit/test_grpo_plan.py": 574,
    "tests/e2e/test_tiny_vlm.py": 531,
    "tests/dist/test_pipeline.py": 466,
    "tests/dist/test_lora.py": 423,
    "tests/unit/test_vision_data.py": 388,
    "tests/dist/test_qlora.py": 315,
    "tests/unit/test_distill_store.py": 314,
    "tests/dist/test_failfast.py": 303,
    "tests/e2e/test_real_templates_train.py": 288,
    "tests/dist/test_preference.py": 264,
    "tests/dist/test_finetune.py": 234,
    "tests/dist/test_grpo_training.py": 214,
    "tests/e2e/test_lineage_cases.py": 212,
    "tests/dist/test_bf16_reshard.py": 212,
    "tests/dist/test_bench.py": 209,
    "tests/dist/test_axes.py": 205,
    "tests/dist/test_qlora_training.py": 197,
    "tests/e2e/test_between_processes.py": 191,
    "tests/dist/test_resume_agreement.py": 189,
    "tests/dist/test_sequence_parallel.py": 186,
    "tests/e2e/test_bad_input.py": 181,
    "tests/dist/test_stages.py": 169,
    "tests/dist/test_bf16_stages.py": 167,
    "tests/unit/test_distill.py": 154,
    "tests/e2e/test_axes_bad_input.py": 124,
    "tests/dist/test_reshard.py": 116,
    "tests/dist/test_async_checkpoints.py": 115,
    "tests/unit/test_plan_matrix.py": 112,
    "tests/unit/test_plan_census.py": 107,
    "tests/dist/test_multinode.py": 103,
    "tests/e2e/test_crash_points.py": 82,
    "tests/unit/test_vision_model.py": 82,
    "tests/dist/test_durability.py": 80,
    "tests/dist/test_kills.py": 79,
    "tests/e2e/test_exports.py": 74,
    "tests/unit/test_vision_cross.py": 72,
    "tests/unit/test_distill_on_policy.py": 64,
    "tests/e2e/test_resume_safety.py": 59,
    "tests/e2e/test_restarts.py": 58,
    "tests/e2e/test_real_templates.py": 57,
    "tests/unit/test_reward_config.py": 56,
    "tests/dist/test_escalation.py": 53,
    "tests/unit/test_gpu_lease.py": 52,
    "tests/e2e/test_resume_errors.py": 51,
    "tests/dist/test_reward_model.py": 47,
    "tests/dist/test_kto.py": 90,  # (this session's, not yet measured in a CI run: alone 56 s)
    "tests/unit/test_kto_config.py": 45,  # (alone 35 s)
    "tests/unit/test_kto_trl.py": 15,  # (alone 10 s)
    "tests/dist/test_step_memory.py": 43,
    "tests/dist/test_slurm.py": 43,
    "tests/e2e/test_reward_to_grpo.py": 42,
    "tests/e2e/test_damaged_files.py": 42,
    "tests/unit/test_vision_plan.py": 40,
    "tests/unit/test_dist.py": 39,
    "tests/e2e/test_lora_memory.py": 39,
    "tests/dist/test_elastic.py": 38,
    "tests/e2e/test_justification.py": 38,
    "tests/unit/test_lineage_crashes.py": 37,
    "tests/unit/test_packing_check.py": 37,
    "tests/unit/test_docs.py": 29,
    "tests/dist/test_observability.py": 29,
    "tests/e2e/test_grpo_bad_input.py": 29,
    "tests/unit/test_plan_axes.py": 27,
    "tests/unit/test_grpo_static_cache.py": 26,
    "tests/e2e/test_global_batch.py": 26,
    "tests/unit/test_grpo_config.py": 25,
    "tests/dist/test_family_matrix_ranks.py": 25,
    "tests/unit/test_cache_key.py": 22,
    "tests/e2e/test_startup.py": 22,
    "tests/unit/test_plan.py": 21,
    "tests/unit/test_reward_trl.py": 19,
    "tests/e2e/test_rollback.py": 19,
    "tests/unit/test_plan_speed.py": 19,
    "tests/e2e/test_checkpoint_interval.py": 18,
    "tests/e2e/test_grpo_learns.py": 18,
    "tests/unit/test_sequence.py": 17,
    "tests/unit/test_pipeline_plan.py": 15,
    "tests/unit/test_qlora_families.py": 11,
    "tests/e2e/test_grpo_trl_rewards.py": 11,
    "tests/unit/test_template_matrix.py": 10,
    "tests/unit/test_grpo_rewards.py": 9,
    "tests/unit/test_family_matrix.py": 9,
    "tests/unit/test_configs_hub.py": 9,
    "tests/unit/test_eval_prompts.py": 8,
    "tests/unit/test_data.py": 8,
}
