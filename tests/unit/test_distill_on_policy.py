"""train.distill.lmbda and seq_kd (trainer/objectives/on_policy.py): each example's last reply cut off and sampled
anew, from the student (on-policy) or the teacher (seq_kd), the step's kind drawn from the seed and the step's place;
through bin/train the losses are the same however a step is split (one rank's 4 x 1 against 2 ranks at ZeRO-3, where
the generation is synced and the teacher sharded), a resume is exact, and bad input stops with the key and the fix."""

import numpy as np
import pytest
import torch
from distill_helpers import make_student, make_teacher
from helpers import ROOT, train

from trainer.data.pack import IGNORE
from trainer.objectives.on_policy import DATA, STUDENT, TEACHER, prompts_of, rows_of, step_kind

teacher_dir = pytest.fixture(scope="module")(make_teacher)
student_dir = pytest.fixture(scope="module")(make_student)
SFT = ROOT / "configs" / "experiments" / "tiny-sft.yaml"
N = IGNORE


def test_the_prompt_is_everything_before_the_last_reply_and_the_rows_put_it_back():
    """A packed row of a two-turn example and a one-turn one, then padding: the prompts are the tokens before each
    example's last run of targets (the first turn's reply is context); the rows made of (prompt, reply) are the
    examples' own tokens, targets and positions, one a row, padded as the data pads."""
    ids = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 0])
    labels = np.array([N, N, 3, N, N, 6, 7, N, N, 10, 11, N, N])  # turn 1: 3; turn 2: 6 7 | one turn: 10 11
    pos = np.array([0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0, 1])
    prompts = prompts_of(np.stack([ids, labels, pos])[None])
    assert prompts == [[1, 2, 3, 4, 5], [8, 9]]
    rows = rows_of([(prompts[0], [6, 7]), (prompts[1], [10, 11, 12])], multiple=1, seq_len=16, pad=0).numpy()
    assert rows.shape == (2, 3, 7)
    assert rows[0].tolist() == [[1, 2, 3, 4, 5, 6, 7], [N, N, N, N, N, 6, 7], [0, 1, 2, 3, 4, 5, 6]]
    assert rows[1].tolist() == [[8, 9, 10, 11, 12, 0, 0], [N, N, 10, 11, 12, N, N], [0, 1, 2, 3, 4, 0, 1]]
    assert (
        rows_of([([1, 2], [3])], multiple=4, seq_len=16, pad=0).shape[-1] == 4
    )  # (the data's width multiple)
    assert rows_of([([1, 2], [3])], multiple=0, seq_len=16, pad=0).shape[-1] == 16  # (0: seq_len wide)
    assert prompts_of(np.stack([ids, np.full(13, N), pos])[None]) == []  # no targets: nothing to complete
    # packed as the data is (review: one example a row made a step's micro batch twice the tokens of the data's):
    # as many a row as fit in seq_len, positions restarting at each
    packed = rows_of(
        [([1, 2], [3]), ([4], [5, 6]), ([7, 8, 9], [10])], multiple=1, seq_len=7, pad=0, pack=True
    )
    assert packed.numpy().tolist() == [
        [[1, 2, 3, 4, 5, 6], [N, N, 3, N, 5, 6], [0, 1, 2, 0, 1, 2]],
        [[7, 8, 9, 10, 0, 0], [N, N, N, 10, N, N], [0, 1, 2, 3, 0, 1]],
    ]


def test_the_plan_holds_a_generated_steps_rows():
    """Review: the plan counted a generated step's micro batch as the data's (rows of seq_len): a row's tokens and a
    new answer of up to max_new_tokens now (planning/generation.py row_length)."""
    from trainer import config
    from trainer.strategy.planning.generation import distill_generates, row_length

    exp = config.load(ROOT / "configs" / "experiments" / "tiny-distill-chat.yaml")
    off = exp.model_copy(
        update={"train": exp.train.model_copy(update={"distill": type(exp.train.distill)(teacher="t")})}
    )
    assert distill_generates(exp) and not distill_generates(off)
    assert row_length(exp) == 256 + 32 and row_length(off) == 256


def test_the_steps_kind_is_drawn_from_the_seed_and_the_place():
    places = [(e, s) for e in range(4) for s in range(0, 10_000, 4)]
    assert {step_kind(0.0, False, 1, e, s) for e, s in places} == {DATA}
    assert {step_kind(0.0, True, 1, e, s) for e, s in places} == {TEACHER}
    assert {step_kind(1.0, True, 1, e, s) for e, s in places} == {STUDENT}
    share = np.mean([step_kind(0.3, False, 1, e, s) == STUDENT for e, s in places])
    assert share == pytest.approx(0.3, abs=0.02)
    again = [step_kind(0.5, True, 1, e, s) for e, s in places[:50]]
    assert again == [step_kind(0.5, True, 1, e, s) for e, s in places[:50]]
    assert again != [step_kind(0.5, True, 2, e, s) for e, s in places[:50]]  # another seed, other draws


def _sets(teacher_dir, student_dir, **more):
    return {"train.objective": "distill", "train.distill.teacher": str(teacher_dir), "train.distill.beta": 0.5,
            "train.distill.temperature": 0.9, "data.seq_len": 128,
            "train.max_steps": 8, "train.log_every": 1, "train.eval_every": 0, "train.eval_prompts": [],
            "optim.lr": 3e-3, "optim.warmup_steps": 0, "model.config": None, "model.pretrained": str(student_dir),
            "checkpoint.save_final": False, **more}  # fmt: skip


PROMPTS = {"data.train.files": "data/tiny/count_chat_prompts.jsonl", "data.train.kind": "prompt",
           "data.eval_fraction": 0, "train.eval_every": 0, "train.eval_prompts": []}  # fmt: skip


def _kinds(run):
    return {m["step"]: (m["on_policy"], m["teacher_completions"]) for m in run.metrics if "on_policy" in m}


def test_split_invariant_over_ranks_and_zero3s_synced_generation(tmp_path, teacher_dir, student_dir):
    """lmbda 0.5 with seq_kd: steps on the student's completions and steps on the teacher's (seed 1234's draws: the
    teacher's at steps 1-5 and 7, the student's at 6 and 8); one rank's 4 x 1 and 2 ranks' 1 x 2 at ZeRO-3 (each
    rank's generate synced with the other's, the teacher sharded and generating too) log the same losses. The
    completions are the student's and the teacher's own: the losses are not the data's completions' ones."""
    mix = {
        "train.distill.lmbda": 0.5,
        "train.distill.seq_kd": True,
        "train.distill.generation.max_new_tokens": 12,
    }
    one = train(tmp_path / "one", _sets(teacher_dir, student_dir, **mix, **{"train.micro_batch_size": 4}),
                experiment=SFT, debug=False)  # fmt: skip
    kinds = _kinds(one)
    assert kinds == {s: (1.0, 0.0) if s in (6, 8) else (0.0, 1.0) for s in range(1, 9)}, kinds
    assert all(0 < m["completion_length"] <= 12 for m in one.metrics if "completion_length" in m)
    assert (
        "objective: distill on the student's completions on a share 0.5 of the steps, the teacher's"
        in one.output
    )
    two = train(tmp_path / "two", _sets(teacher_dir, student_dir, **mix, **{
        "train.micro_batch_size": 1, "train.grad_accum": 2, "strategy.zero_stage": 3,
        "strategy.justification": "generation synced over ranks of a partitioned model"}),
        experiment=SFT, launcher="torchrun", nproc=2, debug=False)  # fmt: skip
    assert "teacher: sharded at ZeRO-3" in two.output
    for step, value in one.losses.items():
        assert two.losses[step] == pytest.approx(value, rel=1e-5), (step, one.losses, two.losses)
    assert _kinds(two) == kinds
    data = train(tmp_path / "data", _sets(teacher_dir, student_dir, **{"train.micro_batch_size": 4}),
                 experiment=SFT, debug=False)  # fmt: skip
    assert all(abs(data.losses[s] - one.losses[s]) > 1e-4 * one.losses[s] for s in (1, 6)), (
        data.losses,
        one.losses,
    )


def test_on_policy_resumes_exactly(tmp_path, teacher_dir, student_dir):
    """lmbda 1 (TRL's DistillationTrainer: every step on the student's completions) over prompt-only data (chat
    prompts rendered with the generation prompt): a resume from step 2 samples the completions the uninterrupted run
    sampled (the draw and the streams from the data's position) and logs its losses after it, bit for bit."""
    sets = _sets(teacher_dir, student_dir, **{"train.distill.lmbda": 1.0, "train.max_steps": 4,
                                              "train.distill.generation.max_new_tokens": 12, **PROMPTS,
                                              "checkpoint.every_steps": 2, "checkpoint.keep_last": 0})  # fmt: skip
    whole = train(tmp_path / "whole", sets, experiment=SFT, debug=False)
    assert "distill reads the prompt alone (the other columns are not used)" in whole.output
    assert {m["on_policy"] for m in whole.metrics if "on_policy" in m} == {1.0}
    ckpt = whole.run_dir / "checkpoints" / "step_00000002"
    again = train(tmp_path / "again", sets, experiment=SFT, debug=False, extra_args=["--resume", str(ckpt)])
    assert {s: v for s, v in again.losses.items() if s > 2} == {
        s: v for s, v in whole.losses.items() if s > 2
    }


BAD = {
    "text": ({"train.distill.lmbda": 0.5}, None,
             r"data.train.kind: train.distill.lmbda \(0.5\) completes the data's prompts: give chat or "
             r"prompt_completion data"),
    "offline": ({"train.distill.seq_kd": True, "train.distill.offline": True, "train.distill.top_k": 8}, SFT,
                r"train.distill.offline: train.distill.seq_kd \(true\): the store holds the teacher at the data's "
                r"completions only"),
    "generation alone": ({"train.distill.generation.max_new_tokens": 8}, SFT,
                         r"train.distill.generation: samples the on-policy \(lmbda > 0\) and the teacher's"),
    "compile": ({"train.distill.lmbda": 1.0, "train.compile": True}, SFT,
                r"train.compile: train.distill.lmbda \(1.0\): generation with it is not verified"),
    "lmbda": ({"train.distill.lmbda": 1.5}, SFT, r"train.distill.lmbda"),
    "prompts without answers": ({"train.distill.lmbda": 0.5, **PROMPTS}, SFT,
                                r"data.train.kind: prompt data has no answers for the steps that are not on-policy "
                                r"\(lmbda 0.5\): set train.distill.lmbda: 1"),
    # review: every token but the first a target: the prompt was the example's first token, silently
    "train_on_prompt": ({"train.distill.lmbda": 1.0, "data.train_on_prompt": True}, SFT,
                        r"data.train_on_prompt: train.distill.lmbda \(1.0\) samples each example's answer"),
    # second review: exit 0 with the eval asked for silently dropped, a mixture a traceback, seq_kd doing nothing
    "prompt data's eval": ({"train.distill.lmbda": 1.0, **PROMPTS, "train.eval_every": 5, "data.eval_fraction": 0.2,
                            "train.eval_prompts": ["x"]}, SFT, r"(?s)(?=.*train.eval_every: prompt data has no answers)"
                           r"(?=.*data.eval: distill over prompt data holds no prompts out)(?=.*train.eval_prompts: dis)"),
    "prompt mixture": ({"train.distill.lmbda": 1.0, **PROMPTS, "data.train": [
        {"files": "data/tiny/count_chat_prompts.jsonl", "kind": "prompt", "weight": 1.0},
        {"files": "data/tiny/count_prompts.jsonl", "kind": "prompt", "weight": 0.5}]}, SFT,
        r"data.train: a mixture of prompt sources is not built for distill"),
    "seq_kd at lmbda 1": ({"train.distill.lmbda": 1.0, "train.distill.seq_kd": True}, SFT,
                          r"train.distill.seq_kd: does nothing at lmbda 1"),
    "preference": ({"data.train.files": "data/tiny/python_prefs.jsonl", "data.train.kind": "preference"}, SFT,
                   r"data.train.kind: distill trains the student on the teacher's distribution at an answer"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_input_stops_with_the_key_and_the_fix(tmp_path, teacher_dir, case):
    import re

    sets, experiment, pattern = BAD[case]
    base = {"train.objective": "distill", "train.distill.teacher": str(teacher_dir), "train.max_steps": 1}
    r = train(tmp_path, {**base, **sets}, experiment=experiment or ROOT / "configs" / "experiments" / "tiny.yaml",
              debug=False, check=False)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.output, r.output[-2000:]
    assert re.search(pattern, r.output), r.output[-2000:]
    assert "Loading weights" not in r.output


def test_the_completions_are_sampled_from_the_prompts(teacher_dir):
    """The stream's rows on a generated step: each example's prompt kept, its reply the sampler's completion (cut at
    seq_len), every completion token a target; the sampler gets each prompt once, with a stream from its tokens."""
    from types import SimpleNamespace

    from trainer.config.distill_schema import DistillSection
    from trainer.data.stream import Position
    from trainer.objectives.on_policy import PolicyStream
    from trainer.rl.generate import Sampling

    ids = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 0])
    labels = np.array([N, N, 3, 4, N, N, N, 8, 9, N])
    pos = np.array([0, 1, 2, 3, 0, 1, 2, 3, 4, 0])
    batch = torch.from_numpy(np.stack([ids, labels, pos])[None])

    class Inner:
        sampler = SimpleNamespace(global_batch=1, usable=100, world=1, rank=0, micro=1)
        position, multiple = Position(), 1

        def next(self):
            return batch

    seen = []

    class Sampler:
        sampling = Sampling(max_new_tokens=4, pad=0)

        def sample(self, prompts, streams):
            seen.append((prompts, streams, self.sampling.width, self.sampling.max_new_tokens))
            return [([40 + i] * (2 + i), True) for i in range(len(prompts))]

    stream = PolicyStream(Inner(), DistillSection(lmbda=1.0), seed=1, seq_len=5)
    stream.attach(Sampler())
    assert stream.loss_denominator(1) == 2 + 2  # [40 40], and [41 41 41] cut where its row reaches seq_len 5
    (rows,) = stream.queue
    # (review: generation ran max_new_tokens past data.seq_len: at most what the longest prompt leaves now)
    assert seen[0][0] == [[1, 2], [5, 6, 7]] and seen[0][2] == 4 and seen[0][3] == 5 - 3
    assert len(set(seen[0][1])) == 2
    assert rows[:, 0].tolist() == [[1, 2, 40, 40, 0], [5, 6, 7, 41, 41]]
    assert rows[:, 1].tolist() == [[N, N, 40, 40, N], [N, N, N, 41, 41]]
    # review: two examples with the same prompt drew the same completion (the stream was the prompt's): each
    # example's stream is its place's now (its row's in the epoch's order, its own in the row)
    twice = np.stack([ids[:4], labels[:4], pos[:4]])
    batch = torch.from_numpy(np.concatenate([twice, twice], axis=1)[None])
    stream.loss_denominator(1)
    assert seen[1][0] == [[1, 2], [1, 2]] and len(set(seen[1][1])) == 2


def test_prompt_rows_are_a_steps_prompts_however_it_is_split():
    """Prompt-only data: a step's prompts over every rank and micro step are the same global slice of the epoch's
    order for one rank's 4 x 1 and 2 ranks' 1 x 2 (so the completions, keyed by the prompt, are too); each row is
    its prompt and one pad target after it, which prompts_of cuts back to the prompt; an epoch rolls over and a
    seek resumes where a step begins."""
    from types import SimpleNamespace

    from trainer.data.stream import Position
    from trainer.objectives.on_policy import PromptRows

    raw = np.full((10, 6), N)
    for i in range(10):
        raw[i, : 2 + i % 4] = np.arange(2 + i % 4) + 10 * i + 1
    data, section = SimpleNamespace(train=raw), SimpleNamespace(shuffle=True)

    def steps(world, micro, accum, n):
        streams = [PromptRows(data, section, rank=r, world=world, micro=micro, accum=accum, seed=3, pad=0)
                   for r in range(world)]  # fmt: skip
        out = []
        for _ in range(n):
            rows = [s.next() for _ in range(accum) for s in streams]
            out.append(sorted(tuple(p) for r in rows for p in prompts_of(r.numpy())))
            for r in rows:
                assert (r[:, 1] != N).sum(dim=1).tolist() == [1] * len(r)  # the one pad target a row
        return out, streams

    one, _ = steps(1, 4, 1, 5)
    two, _ = steps(2, 1, 2, 5)
    assert (
        one == two and len(one[0]) == 4 and one[2] != one[0]
    )  # (8 of 10 rows an epoch: step 3 is epoch 1's)
    assert {tuple(int(t) for t in row if t != N) for row in raw} >= {p for step in one for p in step}
    again = PromptRows(data, section, rank=0, world=1, micro=4, accum=1, seed=3, pad=0)
    again.seek(Position(1, 4))
    assert sorted(tuple(p) for p in prompts_of(again.next().numpy())) == one[3]


def test_review_a_chat_templates_end_of_turn_ends_a_completion(tmp_path):
    """Review: on chat data the chat template's end-of-turn token was no stop token (only prompt data's chat was
    read), so a base model's student (EOS <|endoftext|>, turns ending in <|im_end|>) generated past its turn's end
    and trained on it. Qwen3's tokenizer with a base model's EOS: both stop a completion."""
    from distill_helpers import gpt2_of, qwen3_base_tokenizer

    tok_dir, tok = qwen3_base_tokenizer(tmp_path)
    r = train(tmp_path, {"train.objective": "distill", "train.distill.teacher": str(gpt2_of(tok, tmp_path / "t", 32)),
                         "model.pretrained": str(gpt2_of(tok, tmp_path / "s")), "data.tokenizer": str(tok_dir),
                         "train.distill.lmbda": 1.0, "train.distill.generation.max_new_tokens": 8, "data.seq_len": 128,
                         "train.micro_batch_size": 2, "train.eval_prompts": []},
              experiment=SFT, extra_args=["--dry-run"], debug=False)  # fmt: skip
    assert "stopping at '<|endoftext|>', '<|im_end|>'" in r.output, r.output[-3000:]


def test_review_overfit_batch_is_refused_where_every_step_samples(tmp_path, teacher_dir, student_dir):
    """Review: --overfit-batch trained on the data's rows while the banner said every step was on-policy (and
    logged on_policy 0.0 for steps that drew nothing): refused now, with the fix."""
    r = train(tmp_path, {"train.objective": "distill", "train.distill.teacher": str(teacher_dir),
                         "model.pretrained": str(student_dir), "model.config": None,
                         "train.distill.lmbda": 1.0, "data.seq_len": 128, "train.max_steps": 2,
                         "train.micro_batch_size": 2, "train.eval_prompts": []},
              experiment=SFT, extra_args=["--overfit-batch"], debug=False, check=False)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.output, r.output[-2000:]
    assert (
        "--overfit-batch repeats one batch of the data, and train.distill.lmbda or seq_kd samples" in r.output
    )
