"""The data section of the experiment schema (schema.py holds the rest): one source (`DataSource`) and
the tokenized, packed, per-rank data (`DataSection`); and the chat vocabulary that both the rules
(rules.py) and the data (trainer/data/chat.py, formats.py) read: the roles a message may have and the
keys each formatting's format_map renames."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from trainer.config.fields import FrozenMapping, Globs, Section, auto_or, choice

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")
PRESETS = ("openai", "sharegpt", "alpaca")  # data.train.formatting (null = openai)
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
    "function_call": "assistant", "observation": "tool", "tool": "tool",
}  # fmt: skip
# format_map keys each preset takes, and their defaults
MAP_KEYS: dict[str, dict[str, Any]] = {
    "openai": {"role": "role", "content": "content", "roles": {}, "system": None},
    "sharegpt": {"role": "from", "content": "value", "roles": SHAREGPT_ROLES, "system": "system"},
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": "system",
               "history": "history"},
}  # fmt: skip


class DataSource(Section):
    """One dataset: local files (globs) or a hub dataset."""

    files: Globs | None = Field(
        None, description="file globs (text, json/jsonl, parquet), relative to the current directory"
    )
    hub: str | None = Field(None, description="hub dataset id, loaded with datasets.load_dataset")
    name: str | None = Field(None, description="hub dataset configuration name")
    split: str = Field("train", description="split to read")
    format: choice("auto", "text", "json", "parquet") = Field(
        "auto", description="file format; auto = from the file extension"
    )
    text_field: str = Field("text", description="column holding the text (json/parquet/hub)")
    kind: choice("text", "prompt_completion", "chat", "preference", "prompt", "unpaired") = Field(
        "text",
        description="what a row holds: text (documents packed end to end, every token trained), "
        "prompt_completion (prompt_field + completion_field, the loss on the completion), chat "
        "(messages_field, OpenAI-style messages passed to the chat template as they are: the loss on assistant "
        "turns), preference (prompt_field + chosen_field + rejected_field, for train.objective dpo, ipo, "
        "simpo, orpo; docs/fine-tuning.md) or prompt (prompt_field: a string, or chat messages rendered with the "
        "generation prompt; every other column goes to the reward functions; train.objective grpo, docs/rl.md, or "
        "distill on-policy, docs/distillation.md), or unpaired (prompt_field + completion_field + label_field: one "
        "response labelled desirable or not, or preference pairs taken apart; train.objective kto, "
        "docs/preference.md)",
    )
    prompt_field: str = Field(
        "prompt", description="kinds prompt_completion, preference, prompt, unpaired: the prompt's column"
    )
    completion_field: str = Field(
        "completion", description="kinds prompt_completion, unpaired: the completion's column"
    )
    label_field: str = Field(
        "label",
        description="kind unpaired: the column of each row's label, true (a desirable response) or false (TRL's "
        "unpaired preference format); every row must hold one",
    )
    chosen_field: str = Field(
        "chosen",
        description="kind preference: the preferred response's column (a string or assistant messages)",
    )
    rejected_field: str = Field(
        "rejected",
        description="kind preference: the other response's column (a string or assistant messages)",
    )
    margin_field: str = Field(
        "margin",
        description="kind preference, train.objective reward: the column of each pair's margin (a number the "
        "chosen response's reward must exceed the rejected one's by: TRL's RewardTrainer's margin); used where "
        "the data has it, then every row must hold a number",
    )
    messages_field: str = Field(
        "messages", description="kind chat: the column of message lists (sharegpt: conversations)"
    )
    tools_field: str = Field(
        "tools",
        description="kind chat: the column of each example's tool schemas, passed to the chat template as "
        "tools= (a list, or a JSON string of one); used where the data has it",
    )
    images_field: str = Field(
        "images",
        description="kind chat: the column of each row's images (paths relative to the data file, addresses, "
        "base64), one per <image> placeholder in the messages' text, in order (LLaMA-Factory's form); used where "
        "the data has it. Images may also be content parts of the messages (docs/fine-tuning.md#images)",
    )
    image_field: str = Field(
        "image",
        description="kind chat: the column of a row's single image, at its <image> placeholder or before the first "
        "user message's text; used where the data has it",
    )
    formatting: choice(None, *PRESETS) = Field(
        None,
        description="kind chat: how rows hold conversations: null/openai = OpenAI-style messages (content "
        "strings or parts, tool_calls...), sharegpt = conversations of {from, value}, alpaca = instruction/"
        "input/output; see docs/fine-tuning.md",
    )
    format_map: FrozenMapping = Field(
        default_factory=dict,
        description="kind chat: renames for the formatting's keys: role, content, roles (data's role -> "
        "system/user/assistant/tool), system (a column); alpaca: instruction, input, output, system, history",
    )
    weight: float = Field(
        1.0,
        gt=0,
        description="when data.train lists several sources: this one's share of each epoch (relative)",
    )
    sample_by: choice("document", "paragraph", "line") = Field(
        "document", description="for text files: one sample per file, paragraph or line"
    )


class DataSection(Section):
    """Tokenized, packed, per-rank data."""

    train: DataSource | list[DataSource] = Field(
        description="training data: one source, or a list of sources mixed by their weights"
    )
    eval: DataSource | None = Field(None, description="held-out data; default: `eval_fraction` of train")
    eval_fraction: float = Field(
        0.01, ge=0.0, lt=0.5, description="share of training documents held out for eval (0 = none)"
    )
    tokenizer: str = Field(
        "byte", description="'byte' (built in, 256 bytes + EOS, no files), a local path or a hub id"
    )
    seq_len: int = Field(256, ge=8, description="tokens per packed training sequence")
    append_eos: bool = Field(True, description="append the EOS token after every document")
    num_workers: auto_or(int, "a whole number") = Field(
        "auto",
        description="DataLoader worker processes per rank; auto = from the CPU cores per rank and the device "
        "(see docs/experiments.md)",
    )
    pin_memory: bool = Field(True, description="page-locked host batches (used on GPU only)")
    persistent_workers: bool = Field(True, description="keep workers across epochs (when num_workers > 0)")
    num_proc: int | None = Field(None, ge=1, description="tokenizer processes; null = min(8, CPU cores)")
    shuffle: bool = Field(True, description="reshuffle every epoch (seeded; same order for the same seed)")
    cache_dir: str = Field(
        "~/.cache/trainer/data", description="where tokenized, packed data is cached between runs"
    )
    chat_template: str | None = Field(
        None,
        description="kind chat: a .jinja chat template file; null = the tokenizer's (the byte tokenizer has a "
        "built-in one)",
    )
    train_on_prompt: bool = Field(
        False,
        description="fine-tuning kinds: train on prompt / system / user tokens too (default: answers only)",
    )
    multi_turn: choice("auto", "all", "each", "last") = Field(
        "auto",
        description="chat data with several assistant turns: all = render once, train every turn; each = one "
        "example per turn, rendered as inference sees it (for templates that rewrite history, e.g. Qwen3's "
        "<think>); last = the final turn only; auto = all where the template renders turns consistently, "
        "else each (tested on the template at start)",
    )
    chat_template_kwargs: FrozenMapping = Field(
        default_factory=dict,
        description="extra variables for the chat template (apply_chat_template's kwargs), e.g. "
        "{enable_thinking: false} or {date_string: 26 Jul 2024}",
    )
    group_by_length: bool = Field(
        False,
        description="packing: false: order each run of 1024 sequences of the shuffled epoch by length, so "
        "that micro batches (padded to their longest) waste little on padding",
    )
    packing: bool = Field(
        True,
        description="fine-tuning kinds (and separate_documents): several examples per sequence, each attending "
        "only to itself (position ids restart); false = one example per sequence, each micro batch padded to its "
        "longest",
    )

    @property
    def sources(self) -> list[tuple[str, DataSource]]:
        """The training sources with the key each is reported under."""
        if isinstance(self.train, DataSource):
            return [("data.train", self.train)]
        return [(f"data.train[{i}]", s) for i, s in enumerate(self.train)]

    @property
    def kind(self) -> str:
        """text, or a fine-tuning kind (every source of a mixture has the same: a rule checks it)."""
        return self.sources[0][1].kind

    @property
    def mixture(self) -> bool:
        return not isinstance(self.train, DataSource)

    separate_documents: bool = Field(
        False,
        description="kind text: keep documents apart like fine-tuning examples (each packed document attends "
        "only to itself; one longer than seq_len continues, from position 0, in the next); false = documents "
        "end to end, attending across",
    )
    image_max_pixels: int | None = Field(
        None,
        ge=1,
        description="images larger than this many pixels are scaled down (aspect kept) before the processor: "
        "the image tokens and pixels a row takes are bounded (LLaMA-Factory's image_max_pixels); null = as they are",
    )
    max_images: int | None = Field(
        None,
        ge=1,
        description="the most images a training row holds (an example with more is refused; packing starts a new "
        "row before it would exceed this), and the plan's bound on a row's images; null = as many as the row's "
        "tokens hold, but 1 for Llama 3.2 Vision (an image is one token there)",
    )
    image_min_pixels: int | None = Field(
        None,
        ge=1,
        description="images smaller than this many pixels are scaled up (aspect kept); null = as they are",
    )
    truncation: choice("right", "drop") = Field(
        "right",
        description="fine-tuning kinds, an example longer than seq_len: right = keep its start (the prompt's "
        "start, then as much of the answer as fits), drop = leave it out (both counted)",
    )
