"""train.objective distill, off-policy (trainer/objectives/distill.py): the student's loss through its replaced
forward equals TRL's GKD loss on the same batch's whole logits (the targets' positions, shifted as the token loss
shifts them), loss and gradient; through bin/train the losses are the same however a step is split (4 x 1, 1 x 4,
2 ranks x 2) and fall; bad input stops with the key and the fix (exit 2) before any weight loads."""

import re

import pytest
import torch
from distill_helpers import GPT2, make_student, make_teacher
from helpers import SPLITS, split_losses, train
from transformers import GPT2Config, GPT2LMHeadModel

from trainer.data.pack import IGNORE
from trainer.objectives import distill

teacher_dir = pytest.fixture(scope="module")(make_teacher)
student_dir = pytest.fixture(scope="module")(make_student)


def settings(beta, temperature, squared=False):
    from trainer.config.distill_schema import DistillSection

    return DistillSection(beta=beta, temperature=temperature, temperature_squared=squared)


@pytest.mark.parametrize("beta,temperature,squared", [(1.0, 1.0, False), (0.0, 0.7, False), (0.5, 2.0, True)])
def test_the_students_loss_is_trls_gkd_loss_on_the_batch(teacher_dir, beta, temperature, squared):
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    torch.manual_seed(1)
    student = GPT2LMHeadModel(GPT2Config(**GPT2))
    ref = GPT2LMHeadModel(GPT2Config(**GPT2))
    ref.load_state_dict(student.state_dict())
    teach = distill.teacher(str(teacher_dir), distill.check_vocabulary(str(teacher_dir), student.config))
    distill.attach(student, teach, settings(beta, temperature, squared))
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :10] = IGNORE  # a prompt
    labels[1, 20:] = IGNORE  # padding
    pos = torch.arange(24).repeat(2, 1)
    got = student(input_ids=ids, labels=labels, position_ids=pos, use_cache=False).loss
    got.backward()
    logits = ref(input_ids=ids, position_ids=pos).logits[:, :-1]
    with torch.no_grad():
        t_logits = teach(input_ids=ids, position_ids=pos).logits[:, :-1]
    want = GKDTrainer.generalized_jsd_loss(
        logits, t_logits, labels=labels[:, 1:], beta=beta, temperature=temperature
    )
    want = want * (temperature**2 if squared else 1.0)
    want.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    for (name, a), b in zip(student.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7), name
    assert not any(p.requires_grad for p in teach.parameters())


def test_split_invariant_and_falling(tmp_path, teacher_dir, student_dir):
    """4 x 1, 1 x 4 and 2 ranks x 2 log the same losses (split_losses: 1e-6), which fall; ZeRO-1, 2 and 3 on 2 ranks too
    (at 3 the teacher sharded: half its parameters a rank)."""

    def sets_for(split):
        return {"train.objective": "distill", "train.distill.teacher": str(teacher_dir), "train.distill.beta": 0.5,
                "train.distill.temperature": 0.8, "train.max_steps": 6, "train.log_every": 1, "train.eval_every": 0,
                "train.eval_prompts": [], "optim.lr": 3e-3, "optim.warmup_steps": 0, "model.config": None, "model.pretrained": str(student_dir),
                "checkpoint.save_final": False, **split}  # fmt: skip

    losses = split_losses(tmp_path, sets_for, names=tuple(SPLITS))
    ref = losses["micro4"]
    assert ref[6] < ref[1]
    # ZeRO-3 on 2 ranks: the student's LM head gathered for the divergence (an external parameter), the teacher
    # a whole copy a rank
    # the teacher sharded at ZeRO-3 too (its own inference engine, as TRL's); a whole copy a rank at ZeRO-1 and 2
    whole = sum(p.numel() for p in GPT2LMHeadModel.from_pretrained(teacher_dir).parameters())
    # (and at ZeRO-3 with the parameters offloaded to the host: the teacher's share with the student's)
    offload = {"strategy.offload": "cpu", "strategy.offload_params": True}
    for name, stage, more in (
        ("zero3", 3, {}),
        ("zero1", 1, {}),
        ("zero2", 2, {}),
        ("zero3+cpu", 3, offload),
    ):
        why = (
            {"strategy.justification": "the teacher beside a partitioned model"} if stage < 3 or more else {}
        )
        run = train(tmp_path / name, sets_for({"train.micro_batch_size": 2, "strategy.zero_stage": stage, **why, **more}),
                    launcher="torchrun", nproc=2, debug=False)  # fmt: skip
        for step, value in ref.items():
            assert run.losses[step] == pytest.approx(value, rel=1e-5), (name, run.losses, ref)
        assert ("teacher: sharded at ZeRO-3" in run.output) == (stage == 3)
        if stage == 3:
            held = int(re.search(r"forward\), ([\d,]+) of its", run.output).group(1).replace(",", ""))
            assert held <= whole // 2 + 64 and f"of its {whole:,} parameters on this rank" in run.output


BAD = {
    "missing": ({"train.distill.teacher": "/nowhere/teacher"}, r"train.distill.teacher: cannot load '/nowhere/teacher'"),
    "vocab": ({"train.distill.teacher": "SMALL_VOCAB"},
              r"train.distill.teacher: '.*' has a vocabulary of 100 and the student \(gpt2\) one of 257"),
    "beta": ({"train.distill.beta": 1.5}, r"train.distill.beta"),
    "temperature": ({"train.distill.temperature": 0}, r"train.distill.temperature"),
    "no teacher": ({}, r"train.distill.teacher: distill needs its teacher"),
    "objective": ({"train.objective": "sft"}, r"train.distill: is train.objective distill's; the objective is sft"),
    "chunked": ({"model.chunked_loss": True}, r"model.chunked_loss: distill computes its own divergence"),
    # review: accepted before (loss 0.0000 at every step; a non-finite loss at step 1, exit 4)
    "hot": ({"train.distill.temperature": 1e300}, r"train.distill.temperature"),
    "cold": ({"train.distill.temperature": 1e-300}, r"train.distill.temperature"),
    # review: accepted, and the loss shifted the labels again over sequence parallelism's shifted ones
    "sp": ({"strategy.sequence_parallel": 2}, r"strategy.sequence_parallel: distill with sequence parallelism"),
    # review: said after the weights loaded, with chunked_loss's fix ("set it to false")
    "gemma2": ({"train.distill.teacher": "GEMMA2"}, r"train.distill.teacher \(gemma2\): the model's config sets "
               r"final_logit_softcapping \(30.0: .*\); distill computes the logits from the last hidden states"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_input_stops_with_the_key_and_the_fix(tmp_path, teacher_dir, case):
    sets, pattern = BAD[case]
    if sets.get("train.distill.teacher") == "GEMMA2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        Gemma2ForCausalLM(Gemma2Config(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       final_logit_softcapping=30.0)).save_pretrained(tmp_path / "gemma2")  # fmt: skip
        sets = {"train.distill.teacher": str(tmp_path / "gemma2")}
    if sets.get("train.distill.teacher") == "SMALL_VOCAB":
        GPT2LMHeadModel(GPT2Config(**{**GPT2, "vocab_size": 100})).save_pretrained(tmp_path / "small")
        sets = {"train.distill.teacher": str(tmp_path / "small")}
    base = {"train.objective": "distill", "train.max_steps": 1}
    if case != "no teacher":
        base["train.distill.teacher"] = str(teacher_dir)
    r = train(tmp_path, {**base, **sets}, debug=False, check=False)
    assert r.returncode == 2 and "Traceback" not in r.output, r.output[-2000:]
    import re

    assert re.search(pattern, r.output), r.output[-2000:]
    assert "set it to false" not in r.output and "Loading weights" not in r.output
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))


def test_the_eval_says_the_divergence_not_a_perplexity(tmp_path, teacher_dir):
    """The eval loss of distill is the divergence to the teacher: no perplexity (its exponential means nothing)."""
    r = train(tmp_path, {"train.objective": "distill", "train.distill.teacher": str(teacher_dir), "train.max_steps": 2,
                         "train.eval_every": 2, "train.eval_prompts": [], "checkpoint.save_final": False}, debug=False)  # fmt: skip
    evals = [m for m in r.metrics if "eval_loss" in m]
    assert evals and not any("eval_ppl" in m for m in evals)
    assert "(the divergence to the teacher)" in r.output


def test_the_plan_holds_the_teacher(tmp_path, teacher_dir, capsys):
    """The teacher in every candidate's buffers: its weights in the compute precision (its parameters counted on
    the meta device), its forward's layer in flight and last hidden states, the divergence's block of logits;
    --plan says it. The same job as sft plans that much less."""
    from helpers import TINY, yaml_value

    from trainer import config
    from trainer.objectives.divergence import working_bytes
    from trainer.run.cli import main
    from trainer.strategy.planning.teacher import _four_bit, _shape, teacher_bytes

    sets = {"train.objective": "distill", "train.distill.teacher": str(teacher_dir), "train.precision": "fp32",
            "train.micro_batch_size": 8, "run_dir": str(tmp_path / "run")}  # fmt: skip
    exp = config.load(TINY, [f"{k}={yaml_value(v)}" for k, v in sets.items()])
    params = sum(p.numel() for p in GPT2LMHeadModel.from_pretrained(teacher_dir).parameters())
    assert _shape(str(teacher_dir))[:2] == (params, 96)
    tokens = 8 * exp.data.seq_len
    assert teacher_bytes(exp, 4) == params * 4 + tokens * (
        4 * 96 + 2 * 384
    ) * 4 + tokens * 96 * 4 + working_bytes(tokens, 257)
    main([str(TINY), "--plan", *(f"--set={k}={yaml_value(v)}" for k, v in sets.items())])
    out = capsys.readouterr().out
    line = f"teacher: {teacher_dir} ({params / 1e6:,.1f}M parameters), a whole copy a rank"
    assert line in out, out[-1500:]
    main([str(TINY), "--plan", *(f"--set={k}={yaml_value(v)}" for k, v in sets.items() if "distill" not in k and
                                 "objective" not in k)])  # fmt: skip
    plain = capsys.readouterr().out

    def planned(text):
        return float(text.split("first rung that fits (")[1].split(" MB")[0])

    assert planned(out) - planned(plain) == pytest.approx(
        teacher_bytes(exp, 4) / 2**20, abs=0.01
    )  # (MB: MiB)
    # at ZeRO-3 the teacher is sharded as the student is: its share of the weights, a layer and its head gathered
    share = -(-params // 2) * 4 + (4 * 96 * 96 + 3 * 96 * 384 + 257 * 96) * 4
    assert teacher_bytes(exp, 4, 3, 2) - teacher_bytes(exp, 4) == share - params * 4
    assert (
        teacher_bytes(exp, 4, 3, 2) - teacher_bytes(exp, 4, 3, 2, True) == -(-params // 2) * 4
    )  # (its share offloaded)
    z3 = {**sets, "strategy.zero_stage": 3}
    main([str(TINY), "--plan", "--world-size", "2", *(f"--set={k}={yaml_value(v)}" for k, v in z3.items())])
    assert f"({params / 1e6:,.1f}M parameters), sharded at ZeRO-3 over 2 rank(s)" in capsys.readouterr().out
    off = {**z3, "strategy.offload": "cpu", "strategy.offload_params": True, "strategy.justification": "x"}
    main([str(TINY), "--plan", "--world-size", "2", *(f"--set={k}={yaml_value(v)}" for k, v in off.items())])
    out = (
        capsys.readouterr().out
    )  # (second review: the line said the device's share at the rung that offloads it)
    from trainer.config import format_size

    assert (
        f"its share on the host with the student's parameters: {format_size(teacher_bytes(exp, 4, 3, 2, True))}"
        in out
    )
    # a 4-bit teacher: its linear layers (3 blocks of GPT-2's 4 Conv1D, 96 wide) packed with their NF4 state
    four = config.load(
        TINY, [f"{k}={yaml_value(v)}" for k, v in {**sets, "train.distill.quantization": "4bit"}.items()]
    )
    linear = 3 * (96 * 288 + 96 * 96 + 2 * 96 * 384)
    assert _four_bit(str(teacher_dir))[0] == linear
    assert teacher_bytes(four, 4) - teacher_bytes(exp, 4) == int(_four_bit(str(teacher_dir))[1]) - linear * 4
    main(
        [
            str(TINY),
            "--plan",
            *(
                f"--set={k}={yaml_value(v)}"
                for k, v in {**sets, "train.distill.quantization": "4bit"}.items()
            ),
        ]
    )
    assert "its linear layers in 4 bits (NF4), a whole copy a rank" in capsys.readouterr().out


def test_a_saved_experiment_of_another_objective_loads_again(tmp_path):
    """Checkpoints save the whole experiment (train.distill's defaults with it): an sft checkpoint's experiment.yaml
    loads again (bin/export and --resume read it); train.distill written with another objective is refused."""
    from helpers import TINY

    from trainer import config
    from trainer.common.errors import UserError

    saved = tmp_path / "experiment.yaml"
    saved.write_text(config.load(TINY).to_yaml())
    assert "distill:" in saved.read_text() and config.load(saved).train.objective == "sft"
    with pytest.raises(UserError, match=r"train.distill: is train.objective distill's; the objective is sft"):
        config.load(TINY, ["train.distill.beta=0.5"])


def test_a_lora_student_trains_its_adapters_only(tmp_path, teacher_dir, student_dir):
    """LoRA on the student: the divergence's gradient reaches the adapters through peft's wrapper (the loss falls),
    and the student generates its own completions through it (on-policy, lmbda 1: trainer/objectives/on_policy.py)."""
    from helpers import ROOT

    r = train(tmp_path, {"train.objective": "distill", "train.distill.teacher": str(teacher_dir),
                         "train.distill.lmbda": 1.0, "train.distill.generation.max_new_tokens": 8, "data.seq_len": 128,
                         "model.config": None, "model.pretrained": str(student_dir), "train.micro_batch_size": 4,
                         "model.lora": {"r": 4, "dropout": 0.0, "target_modules": ["c_attn"]}, "train.max_steps": 4,
                         "train.log_every": 1, "train.eval_every": 0, "train.eval_prompts": [], "optim.lr": 1e-2,
                         "optim.warmup_steps": 0, "checkpoint.save_final": False},
              experiment=ROOT / "configs" / "experiments" / "tiny-sft.yaml", debug=False)  # fmt: skip
    assert r.losses[4] < r.losses[1], r.losses
    assert "LoRA" in r.output or "lora" in r.output, r.output[-2000:]
    assert [m["on_policy"] for m in r.metrics if "on_policy" in m] == [1.0] * 4


def test_resume_is_exact_and_another_teacher_is_refused(tmp_path, teacher_dir):
    """A resume from step 2 logs the uninterrupted run's losses after it, bit for bit; a resume whose teacher
    directory now holds other weights (the same path: the experiment is the same) is a change of what the
    checkpoint was trained towards: refused (exit 2), naming it (another path is refused as another experiment)."""
    import shutil

    teacher = tmp_path / "teacher"
    shutil.copytree(teacher_dir, teacher)
    sets = {"train.objective": "distill", "train.distill.teacher": str(teacher), "train.max_steps": 4,
            "train.log_every": 1, "train.eval_every": 0, "train.eval_prompts": [], "checkpoint.every_steps": 2,
            "checkpoint.keep_last": 0, "optim.warmup_steps": 0}  # fmt: skip
    whole = train(tmp_path / "whole", sets, debug=False)
    ckpt = whole.run_dir / "checkpoints" / "step_00000002"
    again = train(tmp_path / "again", sets, debug=False, extra_args=["--resume", str(ckpt)])
    assert {s: v for s, v in again.losses.items() if s > 2} == {
        s: v for s, v in whole.losses.items() if s > 2
    }
    torch.manual_seed(7)
    GPT2LMHeadModel(GPT2Config(**{**GPT2, "n_layer": 1})).save_pretrained(teacher)
    r = train(tmp_path / "other", sets, debug=False, check=False, extra_args=["--resume", str(ckpt)])
    assert r.returncode == 2 and "the teacher (train.distill.teacher)" in r.output, r.output[-2000:]


def test_review_the_heads_gradient_has_no_fp32_copy_and_the_host_holds_the_teachers_load(
    monkeypatch, teacher_dir
):
    """Review findings: the backward made the student head's gradient as a whole fp32 tensor and then a copy in the
    head's precision (2.9 GiB a rank for a Llama 3 8B head, unplanned): now written into the head's precision a
    chunk at a time; the ranks of a node each load the teacher on the host before it moves: the plan's host figure
    holds their copies on a GPU machine (256 GB for an 8B teacher on 8 ranks in fp32 before: it loaded in fp32,
    now in the compute precision)."""
    from helpers import TINY, yaml_value

    from trainer import config
    from trainer.objectives import divergence
    from trainer.strategy.planning.teacher import _shape, teacher_host_bytes

    made = []
    zeros = torch.zeros

    def watched(*shape, **kw):
        made.append(
            (tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape, kw.get("dtype"))
        )
        return zeros(*shape, **kw)

    h_s = torch.randn(6, 8, dtype=torch.bfloat16, requires_grad=True)
    w_s = torch.randn(300, 8, dtype=torch.bfloat16, requires_grad=True)
    loss = divergence.loss(h_s, w_s, torch.randn(6, 4), torch.randn(300, 4), torch.ones(6, dtype=torch.bool), 0.5,
                           1.0, 6)  # fmt: skip
    monkeypatch.setattr(torch, "zeros", watched)
    loss.backward()
    monkeypatch.undo()
    assert w_s.grad.dtype == torch.bfloat16
    assert ((300, 8), torch.float32) not in made, made
    exp = config.load(
        TINY, ["train.objective=distill", f"train.distill.teacher={yaml_value(str(teacher_dir))}"]
    )
    assert teacher_host_bytes(exp, 2, 8) == 8 * _shape(str(teacher_dir))[0] * 2
