"""GRPO's stream and sampler (trainer/rl/rollout.py, generate.py): the review's findings, each a test that fails
without its fix. The first step of an epoch is seeded by that epoch, whether the run got there or resumed there;
a group has a learning signal only where its combined rewards differ (functions that cancel out give none);
the reward functions get the prompts as the data gives them and completions without the stop token; sampling
is the one asked for, whatever the model's published generation_config says."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainer.data.pack import IGNORE
from trainer.data.prompts import PROMPT, build_prompts
from trainer.data.stream import Position
from trainer.data.tokenizer import byte_tokenizer
from trainer.rl.generate import ModelSampler, Sampling
from trainer.rl.rollout import RolloutStream, Scored, _spread, group_seed

RL = SimpleNamespace(num_generations=2, max_new_tokens=2, num_iterations=1, dynamic_sampling=False, max_resamples=1,
                     weights=lambda: [1.0])  # fmt: skip


def stream(n=6, rows=None):
    prompts = np.full((n, 3), IGNORE, dtype=np.int32)
    prompts[:, :2] = 65
    data = SimpleNamespace(train=prompts, columns=rows or [{PROMPT: f"p{i}"} for i in range(n)])
    return RolloutStream(data, SimpleNamespace(shuffle=True), RL, rank=0, world=1, micro=2, accum=1, seed=7,
                         seq_len=16, tokenizer=byte_tokenizer())  # fmt: skip


def test_the_first_step_of_an_epoch_is_seeded_by_that_epoch_however_it_is_reached():
    s = stream()
    takes = [s._take() for _ in range(7)]  # 6 prompts, 1 a step: the 7th is epoch 1's first
    _, places, epoch = takes[6]
    assert epoch == 1 and places == [0]
    resumed = stream()
    resumed.seek(Position(0, 6))  # a checkpoint at the end of epoch 0
    assert resumed._take() == takes[6]
    assert group_seed(7, 1, 0) != group_seed(7, 0, 0)


def test_a_group_has_a_signal_only_where_its_combined_rewards_differ():
    cancel = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # two functions that cancel out: combined 1, 1
    differ = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    missing = torch.tensor(
        [[float("nan"), float("nan")], [1.0, 0.0]]
    )  # one completion every function left None
    s = Scored([0, 1, 2], [([1], True)] * 6, torch.cat([cancel, differ, missing]))
    assert _spread(s, 2, [1.0, 1.0]) == [False, True, False]


def test_rewards_get_the_prompts_as_given_and_completions_without_the_stop_token():
    tok = byte_tokenizer()
    section = SimpleNamespace(train=SimpleNamespace(prompt_field="prompt", kind="prompt"), seq_len=32)
    raw = [{"prompt": "How many?", "answer": "3"}, {"prompt": "And now?", "answer": "4"}]
    try:
        prompts, columns, _ = build_prompts(raw, tok, section)
    except AttributeError as e:  # the section's other fields: a real one
        pytest.skip(f"build_prompts needs {e}")
    s = stream(n=2, rows=columns)
    s.prompts = prompts
    seen = {}

    def reward(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, columns=columns)
        return [1.0] * len(completions)

    from trainer.rl.rewards import Reward

    eos = tok.eos_token_id
    s.attach(SimpleNamespace(sample=lambda ps, seed: [([ord("3"), eos], True)] * len(ps)), None,
             [Reward("r", reward, 1.0, {})])  # fmt: skip
    s._score([0, 1], [1, 2])
    assert seen["prompts"] == ["How many?", "How many?", "And now?", "And now?"]
    assert seen["completions"] == ["3"] * 4
    assert seen["columns"]["answer"] == ["3", "3", "4", "4"]
    assert seen["columns"]["completion_ids"] == [[ord("3"), eos]] * 4  # TRL's: up to and including the stop


def test_sampling_sets_the_model_s_generation_config_aside():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=257)).eval()
    engine = SimpleNamespace(ds=SimpleNamespace(module=model), device=torch.device("cpu"))
    sampler = ModelSampler(engine, Sampling(max_new_tokens=8, stop=(256,), pad=256), synced=False, batch=4)
    prompts = [[72, 105, 33]] * 4
    clean = sampler.sample(prompts, [3, 4, 5, 6])
    model.generation_config.repetition_penalty = 50.0  # as a published generation_config.json may hold
    model.generation_config.no_repeat_ngram_size = 1
    assert sampler.sample(prompts, [3, 4, 5, 6]) == clean
    assert model.generation_config.repetition_penalty == 50.0  # given back


# ----------------------------------------------------------------------------- sampling: Gumbel-max, per-row streams


def test_the_noise_is_splitmix64_of_the_row_s_stream_the_step_and_the_token():
    import math

    from trainer.rl.generate import gumbel

    mask = (1 << 64) - 1

    def mix(x):  # splitmix64's finalizer, in Python's integers
        x &= mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    streams = [12345, (1 << 62) + 77, 3]
    got = gumbel(torch.tensor(streams), 5, 7)
    for r, s in enumerate(streams):
        for t in range(7):
            u = ((mix(s + (5 * 7 + t) * 0x9E3779B97F4A7C15) >> 41) + 0.5) * 2.0**-23
            assert got[r, t].item() == pytest.approx(-math.log(-math.log(u)), rel=1e-6, abs=1e-6)
    # a row's noise is its own: the same alone as beside others
    assert torch.equal(gumbel(torch.tensor(streams[1:2]), 5, 7), got[1:2])


def test_gumbel_max_samples_the_processed_distribution_and_processing_is_transformers():
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from trainer.rl.generate import gumbel, processed

    torch.manual_seed(0)
    scores = torch.randn(3, 50) * 3
    for t, k, p in [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.9, 5, 0.6)]:
        ours = processed(scores, Sampling(max_new_tokens=1, temperature=t, top_k=k, top_p=p))
        theirs = TemperatureLogitsWarper(t)(None, scores)
        theirs = TopKLogitsWarper(k)(None, theirs) if k else theirs
        theirs = TopPLogitsWarper(p)(None, theirs) if p < 1 else theirs
        assert torch.equal(ours, theirs), (t, k, p)
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, -30.0])
    n = 40000
    drawn = (logits + gumbel(torch.arange(n) * 1000003 + 11, 0, 5)).argmax(dim=1)
    freq = torch.bincount(drawn, minlength=5).double() / n
    want = logits.double().softmax(0)
    assert torch.all((freq - want).abs() <= 4 * (want * (1 - want) / n).sqrt() + 1e-9), (freq, want)


def test_a_completion_does_not_depend_on_the_rows_that_share_its_generate_call():
    """Two prompts of different lengths, two completions each, sampled in one call of 4 rows, two of 2 and
    four of 1: the same completions (each row's own noise, the prompts padded to the data's longest)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=257, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    engine = SimpleNamespace(ds=SimpleNamespace(module=model), device=torch.device("cpu"))
    prompts = [[72, 105, 33, 40, 41], [72, 105, 33, 40, 41], [65, 66], [65, 66]]
    streams = [11, 12, 13, 14]
    sampling = Sampling(max_new_tokens=12, stop=(256,), pad=256, width=5)
    drawn = {
        b: ModelSampler(engine, sampling, synced=False, batch=b).sample(prompts, streams) for b in (4, 2, 1)
    }
    assert drawn[4] == drawn[2] == drawn[1], drawn
    assert drawn[4][0] != drawn[4][1]  # a group's completions are drawn apart


# ----------------------------------------------------------------------------- where a completion ends; min_p

# the published generation_config.json's eos_token_id of the instruct models of these tokenizers
PUBLISHED = {
    "llama3_2": (
        [128001, 128008, 128009],
        "<|eot_id|>",
    ),  # Llama-3.2-1B-Instruct: end_of_text, eom_id, eot_id
    "qwen3": ([151645, 151643], "<|im_end|>"),  # Qwen3-0.6B: im_end, endoftext
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_generation_stops_at_every_end_token_trl_and_generate_stop_at(name):
    from helpers import tokenizer_dir
    from transformers import AutoTokenizer, GenerationConfig

    from trainer.rl.generate import stop_tokens

    tok = AutoTokenizer.from_pretrained(tokenizer_dir(name))
    listed, eot = PUBLISHED[name]
    stop = stop_tokens(tok, eot, GenerationConfig(eos_token_id=listed))
    # TRL's GRPOTrainer: the tokenizer's EOS and the generation config's list; generate: the list
    assert {tok.eos_token_id, *listed} <= set(stop), (stop, listed)
    assert tok.convert_tokens_to_ids(eot) in stop and len(stop) == len(set(stop))
    before = stop_tokens(tok, eot)  # (without the generation config: what sampling stopped at before)
    assert set(listed) - set(before), "the published list adds nothing: the test would not see the fix"


def test_a_completion_ends_at_an_end_token_only_the_generation_config_lists():
    from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

    from trainer.rl.generate import stop_tokens

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=257)).eval()
    engine = SimpleNamespace(ds=SimpleNamespace(module=model), device=torch.device("cpu"))
    prompts, streams = [[72, 105, 33]] * 2, [3, 4]
    free = ModelSampler(engine, Sampling(max_new_tokens=12, stop=(256,), pad=256), synced=False, batch=2)
    (row, ended), _ = free.sample(prompts, streams)
    assert not ended and len(row) == 12
    eom = row[4]  # a token the model draws: as if its generation config listed it as an end token
    stop = stop_tokens(byte_tokenizer(), "", GenerationConfig(eos_token_id=[256, eom]))
    sampler = ModelSampler(engine, Sampling(max_new_tokens=12, stop=stop, pad=256), synced=False, batch=2)
    (cut, ended), _ = sampler.sample(prompts, streams)
    assert ended and cut == row[: row.index(eom) + 1]


def test_min_p_is_transformers_min_p_after_the_other_warpers():
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper

    from trainer.rl.generate import processed

    torch.manual_seed(0)
    scores = torch.randn(4, 60) * 3
    for t, k, m in [(1.0, 0, 0.1), (0.7, 10, 0.05), (1.3, 0, 0.5), (1.0, 0, 1.0)]:
        ours = processed(scores, Sampling(max_new_tokens=1, temperature=t, top_k=k, min_p=m))
        theirs = TemperatureLogitsWarper(t)(None, scores)
        theirs = TopKLogitsWarper(k)(None, theirs) if k else theirs
        theirs = MinPLogitsWarper(m)(None, theirs)
        assert torch.equal(ours, theirs), (t, k, m)
        assert (ours > -torch.inf).sum() < scores.numel()  # something was dropped


def test_one_rule_for_long_prompts_they_are_left_out_and_counted():
    """Issue 74 item 5: a prompt over seq_len - max_new_tokens by a few tokens stopped the run (exit 2) while one
    over seq_len was dropped and counted: one rule now, a prompt that leaves fewer than max_new_tokens within
    data.seq_len is left out and counted (its columns with it); the run stops only where none is left."""
    from trainer.common.errors import UserError

    prompts = np.full((6, 15), IGNORE, dtype=np.int32)
    for i, n in enumerate([3, 14, 5, 15, 4, 6]):  # seq_len 16, max_new_tokens 2: at most 14 fit
        prompts[i, :n] = 65 + i
    data = SimpleNamespace(train=prompts, columns=[{PROMPT: f"p{i}", "i": i} for i in range(6)])
    s = RolloutStream(data, SimpleNamespace(shuffle=True), RL, rank=0, world=1, micro=2, accum=1, seed=7,
                      seq_len=16, tokenizer=byte_tokenizer())  # fmt: skip
    assert s.left_out == 1 and len(s.prompts) == 5 and [c["i"] for c in s.columns] == [0, 1, 2, 4, 5]
    assert s.longest == 14 and all(
        int(p[0]) == 65 + c["i"] for p, c in zip(s.prompts, s.columns, strict=True)
    )
    with pytest.raises(UserError, match="every prompt and its completion would exceed data.seq_len 4"):
        RolloutStream(data, SimpleNamespace(shuffle=True), RL, rank=0, world=1, micro=2, accum=1, seed=7,
                      seq_len=4, tokenizer=byte_tokenizer())  # fmt: skip
