"""Metrics: measurements (`measure.py`: throughput, MFU, memory, data wait, stragglers), collected
and reduced by `Metrics` (`recorder.py`), written by the sinks on rank 0 (`sinks.py`: console and
progress bar, metrics.jsonl; `wandb_run.py`: Weights & Biases)."""

from trainer.metrics.measure import peak_flops, peak_memory
from trainer.metrics.recorder import HISTORY, Metrics
from trainer.metrics.sinks import setup_logging

__all__ = ["HISTORY", "Metrics", "peak_flops", "peak_memory", "setup_logging"]
