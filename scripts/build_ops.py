"""Build DeepSpeed's CPU Adam now, ahead of the first run that offloads the optimizer (`make ops`).

DeepSpeed compiles the op (DeepSpeedCPUAdam, which `strategy.offload: cpu` uses) with ninja/g++ the
first time a run needs it: about two minutes of CPU, during which that run's ranks wait. This does
it once, beforehand, into DeepSpeed's JIT cache (~/.cache/torch_extensions, or
$TORCH_EXTENSIONS_DIR), where every later run finds it. A failure here (no compiler, say) is
reported; the op is then built, or its absence reported, when a run first needs it.

    python scripts/build_ops.py
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run before the package is installed
from trainer.cluster.dist import build_ops_without_debug_info, prefer_interpreter_tools  # noqa: E402


def main() -> int:
    t0 = time.perf_counter()
    # The venv's ninja, as in every run: a build by another ninja looks changed to it and is redone.
    prefer_interpreter_tools()
    try:
        build_ops_without_debug_info()  # the flags every run builds with (trainer.cluster.dist.setup)
        from deepspeed.ops.op_builder import CPUAdamBuilder

        builder = CPUAdamBuilder()
        if not builder.is_compatible(verbose=False):
            print("build_ops: DeepSpeed's CPU Adam is not compatible with this machine; skipped")
            return 0
        builder.load(verbose=False)
    except Exception as e:  # noqa: BLE001 - any failure is reported, and the run builds it later
        print(
            f"build_ops: DeepSpeed's CPU Adam did not build ({type(e).__name__}: {e}); "
            "it will be built when a run first offloads the optimizer"
        )
        return 1
    print(f"build_ops: DeepSpeed's CPU Adam is ready ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
