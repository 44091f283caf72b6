"""Experiment configuration: one YAML file -> a typed, immutable `Experiment`.

- `schema.py`: the sections a user reads (one pydantic model each; descriptions = the reference);
- `data_schema.py`: the data section, and the chat vocabulary (`ROLES`, `MAP_KEYS`) the data reads;
- `rules.py`: contradictions between fields, and warnings;
- `loading.py`: YAML with line numbers, `--set` overrides, validation, every problem at once;
- `fields.py`: the field types (choices, sizes, globs, read-only mappings);
- `describe.py`: the fields as the reference's rows.

Precedence is defaults < YAML < `--set section.key=value`.
"""

from trainer.common.units import format_size, parse_size
from trainer.config import (
    axes_rules,  # noqa: F401  (registers its rules)
    reward_rules,  # noqa: F401  (registers its rules)
)
from trainer.config.data_schema import MAP_KEYS, PRESETS, ROLES
from trainer.config.describe import describe, describe_table
from trainer.config.fields import thaw
from trainer.config.loading import apply_override, load, parse_yaml, validate
from trainer.config.rules import warnings
from trainer.config.schema import (
    CHUNKED_LOSS_TYPES,
    LOSS_CHUNK_BYTES,
    SECTIONS,
    TEMPLATES_DIR,
    CheckpointSection,
    DataSection,
    DataSource,
    DistSection,
    Experiment,
    LoggingSection,
    ModelSection,
    OptimSection,
    StrategySection,
    TrainSection,
    WandbSection,
    chunked_loss_problem,
    loss_chunk_rows,
)

__all__ = [
    "CHUNKED_LOSS_TYPES",
    "LOSS_CHUNK_BYTES",
    "MAP_KEYS",
    "PRESETS",
    "ROLES",
    "SECTIONS",
    "TEMPLATES_DIR",
    "CheckpointSection",
    "DataSection",
    "DataSource",
    "DistSection",
    "Experiment",
    "LoggingSection",
    "ModelSection",
    "OptimSection",
    "StrategySection",
    "TrainSection",
    "WandbSection",
    "apply_override",
    "chunked_loss_problem",
    "describe",
    "describe_table",
    "format_size",
    "load",
    "loss_chunk_rows",
    "parse_size",
    "parse_yaml",
    "thaw",
    "validate",
    "warnings",
]
