"""What bin/train changes in DeepSpeed's start-up, each a measured cost of every rank at every start
(BENCHMARKS.md): no debug information in its JIT-built ops, no shared-memory all-reduce op built for
inference, its Muon module imported without TorchInductor, the CPU's description read once. Each
falls back to DeepSpeed's own behaviour when DeepSpeed renames what it changes. trainer/cluster/dist.py
calls them in `setup`."""

from __future__ import annotations

import importlib
import sys
from typing import Any


def build_ops_without_debug_info() -> None:
    """DeepSpeed JIT-compiles its C++ ops (CPU Adam for `strategy.offload`, once per machine) with
    `-g`: debug information nobody reads, which costs about a third of the compile. The ops are
    built the same otherwise (-O3, -march=native), so they run at the same speed. Every process
    that may build an op calls this (each rank, and scripts/build_ops.py), so they agree on the
    flags and none rebuilds what another built. (If DeepSpeed renames jit_load, the ops are built
    with its own flags, as before.)"""
    builder = importlib.import_module("deepspeed.ops.op_builder.builder")
    base = getattr(builder, "OpBuilder", None)
    if base is None or not hasattr(base, "jit_load") or getattr(base.jit_load, "_no_debug_info", False):
        return
    jit_load = base.jit_load

    def lean_jit_load(self: Any, *args: Any, **kwargs: Any) -> Any:
        cxx_args = self.cxx_args
        self.cxx_args = lambda: [a for a in cxx_args() if a != "-g"]
        try:
            return jit_load(self, *args, **kwargs)
        finally:
            del self.cxx_args

    lean_jit_load._no_debug_info = True  # type: ignore[attr-defined]
    base.jit_load = lean_jit_load


def skip_inference_shm_op() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op when it initialises (40 s
    on a fresh machine, a ninja run at every start after) that only inference tensor parallelism
    uses (module_inject's inference_all_reduce); ZeRO training all-reduces through torch.distributed.
    The op also leaves /dev/shm/deepspeed_allreduce_buffer_* behind, which DeepSpeed never removes.
    Training does not build it. (If DeepSpeed renames the hook, the op is built as before, and the
    fail-fast tests, which check /dev/shm after every run, say so.)"""
    # The module itself: the attribute deepspeed.comm.torch is the torch package, not this module.
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_torch, "build_shm_op"):
        ds_torch.build_shm_op = lambda: None


def import_muon_lazily() -> None:
    """DeepSpeed imports its Muon optimizer module at ZeRO stages >= 1 whatever the optimizer (in
    its optimizer check, in stage 1/2's first gradient reduction, in stage 3's set-up), and that
    module's @torch.compile decorators import all of TorchInductor: seconds of CPU in every rank at
    every start. Imported here first, with those decorators compiling at the first call instead
    of at the import, it costs nothing; Muon itself works as before (compiled when first used).
    (If DeepSpeed moves or renames these, the module is imported as before.)"""
    import functools

    name = "deepspeed.runtime.zero.muon.muon_optimizer"
    if name in sys.modules:
        return
    try:
        compiler = importlib.import_module("deepspeed.runtime.compiler")
    except ImportError:
        return
    eager_compile = getattr(compiler, "compile", None)
    if eager_compile is None:
        return

    def compile_at_first_call() -> Any:
        def decorate(fn: Any) -> Any:
            compiled = None

            @functools.wraps(fn)
            def call(*args: Any, **kwargs: Any) -> Any:
                nonlocal compiled
                if compiled is None:
                    compiled = eager_compile()(fn)
                return compiled(*args, **kwargs)

            return call

        return decorate

    compiler.compile = compile_at_first_call
    try:
        importlib.import_module(name)
    except ImportError:
        pass
    finally:
        compiler.compile = eager_compile


def read_cpu_info_once() -> None:
    """py-cpuinfo's get_cpu_info starts a Python process (`python cpuinfo.py --json`: 0.66 s of CPU
    here), and DeepSpeed asks it three times in every rank that offloads the optimizer
    (DeepSpeedCPUAdam's vendor check, then its op builder's -march and SIMD flags at load). The CPU
    does not change while a process runs: the first answer is kept and a copy returned after.
    (If py-cpuinfo is missing or renames get_cpu_info, DeepSpeed asks it as before.)"""
    import copy
    import functools

    try:
        cpuinfo = importlib.import_module("cpuinfo")
    except ImportError:
        return
    ask = getattr(cpuinfo, "get_cpu_info", None)
    if ask is None or getattr(ask, "_once", False):
        return
    first = functools.cache(ask)

    def get_cpu_info() -> dict:
        return copy.deepcopy(first())

    get_cpu_info._once = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info


def string_keys_in_output_registry() -> None:
    """AutoEP (DeepSpeed 0.19.8) moves a mixture's router-logit recorders to its own router by reading and
    restoring transformers' output-capture registry as a dict: `registry.get(key)` and `registry.get(key,
    default)` with the class's name as the key. transformers 5.24's `_CanRecordRegistry.get` takes a model and
    no default (`get() takes 2 positional arguments but 3 were given`: every AutoEP run of Mixtral or Qwen3-MoE
    stopped there). A name (a str) is looked up as the dict it is; a model as transformers does. (If
    transformers renames the registry, or its get takes a default again, nothing changes.)"""
    try:
        capturing = importlib.import_module("transformers.utils.output_capturing")
    except ImportError:
        return
    registry = getattr(capturing, "_CanRecordRegistry", None)
    get = getattr(registry, "get", None)
    if registry is None or get is None or getattr(get, "_string_keys", False):
        return

    def string_or_model_get(self: Any, key: Any, *default: Any) -> Any:
        if isinstance(key, str):
            return dict.get(self, key, *default)
        return get(self, key)

    string_or_model_get._string_keys = True  # type: ignore[attr-defined]
    registry.get = string_or_model_get
