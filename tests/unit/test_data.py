"""Data: byte tokenizer, packing, the cache (built once per node), and the global data order."""

import json
import multiprocessing as mp

import numpy as np
import pytest

from trainer import config
from trainer.common.errors import UserError
from trainer.data import RankSampler, build, byte_tokenizer
from trainer.data.pack import IGNORE
from trainer.data.stream import _collate


def test_byte_tokenizer_ids_are_utf8_bytes(tmp_path):
    tok = byte_tokenizer()
    text = "Hello, wörld!\n\ttabs  and spaces"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert len(tok) == 257 and tok.eos_token_id == 256
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path)(text, add_special_tokens=False)["input_ids"] == ids


def section(tmp_path, **kw):
    docs = tmp_path / "docs.jsonl"
    if not docs.exists():
        docs.write_text("".join(json.dumps({"text": f"document {i} " * (5 + i)}) + "\n" for i in range(40)))
    raw = {
        "train": {"files": str(docs)},
        "seq_len": 16,
        "eval_fraction": 0.1,
        "cache_dir": str(tmp_path / "cache"),
        **kw,
    }
    return config.DataSection.model_validate(raw)


def _stream(docs):
    """The byte tokenizer's token stream of `docs`: UTF-8 bytes, EOS (256) after each."""
    return np.array([t for d in docs for t in [*d.encode(), 256]], dtype=np.int32)


def test_packing_and_eval_split(tmp_path):
    s = section(tmp_path)
    data = build(s, seed=0)
    stream = _stream(f"document {i} " * (5 + i) for i in range(40))
    n = len(data.train) + len(data.eval)
    assert n == -(-len(stream) // 16)  # every token in a block, the last one padded
    assert len(data.eval) == int(np.ceil(n * 0.1))
    rows = data.train[:]
    assert rows.shape == (len(data.train), 16)
    flat = np.concatenate([rows.reshape(-1), data.eval[:].reshape(-1)])
    assert (flat[: len(stream)] == stream).all() and (flat[len(stream) :] == IGNORE).all()
    assert data.targets is None  # the padded block is held out for eval: training rows are all full


@pytest.mark.parametrize("num_proc", [1, 2])
def test_packing_text_loses_no_tokens(tmp_path, num_proc):
    """2,500 documents: three map batches of 1,000 (two processes with num_proc 2), whose ends once
    each dropped up to seq_len - 1 tokens. Every token is counted into the blocks, in order."""
    docs = [f"doc {i}: " + "abc " * (i % 7) for i in range(2500)]
    (tmp_path / "many.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    s = section(tmp_path, train={"files": str(tmp_path / "many.jsonl")}, eval_fraction=0.0, num_proc=num_proc)
    data = build(s, seed=0)
    stream = _stream(docs)
    flat = data.train[:].reshape(-1)
    assert len(data.train) == -(-len(stream) // 16) and len(stream) % 16  # a padded last block
    assert (flat[: len(stream)] == stream).all() and (flat[len(stream) :] == IGNORE).all()
    # The padded block is in training: its targets are counted for the loss, and a batch that draws
    # it becomes rows whose padding is neither input nor target.
    assert list(data.targets[:-1]) == [15] * (len(data.train) - 1)
    assert data.targets[-1] == len(stream) % 16 - 1
    batch = _collate(data.train[[0, len(data.train) - 1]])
    assert tuple(batch.shape) == (2, 3, 16)
    assert (batch[:, 1][batch[:, 1] >= 0] == batch[:, 0][batch[:, 1] >= 0]).all()
    assert (batch[:, 0] >= 0).all() and (batch[1, 1, len(stream) % 16 :] == IGNORE).all()
    assert batch[:, 2].tolist() == [list(range(16))] * 2
    assert tuple(_collate(data.train[[0, 1]]).shape) == (2, 16)  # full blocks stay blocks


def test_separate_documents_keeps_every_token_and_restarts_positions(tmp_path):
    docs = [f"document {i} " * (1 + 2 * i) for i in range(6)]  # 12 to 122 tokens: 5 longer than 16
    (tmp_path / "few.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    s = section(tmp_path, train={"files": str(tmp_path / "few.jsonl")}, eval_fraction=0.0,
                separate_documents=True)  # fmt: skip
    data = build(s, seed=0)
    expected = [p.tolist() for d in docs for p in np.split(_stream([d]), range(16, len(d) + 1, 16))]
    assert min(map(len, expected)) > 1 and data.supervised and data.finetune["split"] == 5
    found = []  # each row: pieces, each from position 0, then padding (no target)
    for ids, labels, pos in data.train[:]:
        for at in np.split(np.arange(16), np.flatnonzero(pos == 0)[1:]):
            if (labels[at] != IGNORE).any():
                assert (labels[at][1:] == ids[at][1:]).all() and labels[at][0] == IGNORE
                found.append(ids[at].tolist())
    assert found == expected
    assert (
        data.finetune["target_tokens"]
        == sum(len(p) - 1 for p in expected)
        == (data.train[:, 1] != IGNORE).sum()
    )


def test_second_build_reads_the_cache(tmp_path):
    s = section(tmp_path)
    first = build(s, seed=0)
    second = build(s, seed=0)
    assert first.built and not second.built and first.cache_path == second.cache_path
    assert (second.train[:] == first.train[:]).all()
    # A change in the source (or seq_len, tokenizer...) is a new cache entry.
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "other " * 100}) + "\n")
    assert build(s, seed=0).cache_path != first.cache_path


def _build_in_child(s_json, q):
    s = config.DataSection.model_validate_json(s_json)
    q.put(build(s, seed=0).built)


def test_concurrent_builders_build_once(tmp_path):
    s = section(tmp_path)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(s.model_dump_json(), q)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert sorted(q.get(timeout=5) for _ in procs) == [False, False, True]


def test_empty_and_missing(tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(UserError, match="empty"):
        build(section(tmp_path, train={"files": str(tmp_path / "e.jsonl")}), seed=0)
    with pytest.raises(UserError, match="matches no file"):
        build(section(tmp_path, train={"files": str(tmp_path / "none*.jsonl")}), seed=0)


def rank_order(n, world, micro, seed=1, epoch=0, start=0):
    out = []
    for r in range(world):
        s = RankSampler(n, r, world, micro, seed, shuffle=True)
        s.set_epoch(epoch, start)
        out.append(list(s))
    return out


def test_ranks_take_disjoint_slices_of_each_global_batch():
    a, b = rank_order(100, 2, 4)
    assert len(a) == len(b) == (100 // 8) * 4
    assert not set(a) & set(b)
    perm = RankSampler(100, 0, 2, 4, 1, True).order(0)
    for i in range(len(a) // 4):  # global micro step i = perm[8i:8i+8], rank r its 4-slice
        assert a[4 * i : 4 * i + 4] + b[4 * i : 4 * i + 4] == list(perm[8 * i : 8 * i + 8])


def test_global_order_does_not_depend_on_world_size():
    one = rank_order(96, 1, 8)[0]
    two = rank_order(96, 2, 4)
    four = rank_order(96, 4, 2)
    for i in range(96 // 8):
        batch = set(one[8 * i : 8 * i + 8])
        assert batch == set(two[0][4 * i : 4 * i + 4] + two[1][4 * i : 4 * i + 4])
        assert batch == {x for r in four for x in r[2 * i : 2 * i + 2]}


def test_resume_from_a_position_continues_the_same_sequence():
    full = rank_order(100, 2, 4, epoch=3)
    resumed = rank_order(100, 2, 4, epoch=3, start=5 * 8)
    assert resumed[0] == full[0][20:] and resumed[1] == full[1][20:]
    # ...and on another world size the remaining global batches are the same samples
    other = rank_order(100, 1, 8, epoch=3, start=5 * 8)[0]
    assert set(other) == set(full[0][20:]) | set(full[1][20:])


def test_epochs_reshuffle_deterministically():
    assert rank_order(50, 1, 5, epoch=0) != rank_order(50, 1, 5, epoch=1)
    assert rank_order(50, 1, 5, epoch=1) == rank_order(50, 1, 5, epoch=1)


def test_a_cache_hit_reads_memory_mapped_blocks_without_importing_datasets(tmp_path):
    """Every rank of every run reads the cache: it must not pay for `import datasets` (0.6-0.8 s of
    CPU per process) nor copy the data."""
    import subprocess
    import sys

    s = section(tmp_path)
    build(s, seed=0)
    code = (
        "import sys; from trainer import config; from trainer.data import build; "
        f"d = build(config.DataSection.model_validate_json({s.model_dump_json()!r}), seed=0); "
        "print(d.built, type(d.train).__name__, d.train.dtype, d.train.shape[1], 'datasets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "memmap", "int32", "16", "False"], out


def test_data_changes_name_what_differs():
    from trainer.data import data_changes

    saved = {"train_sequences": 10, "train_digest": "a", "tokenizer": "byte:257:x",
             "sources": {"files": [["/d/a.jsonl", 100, 1], ["/d/b.jsonl", 50, 1]]}}  # fmt: skip
    assert data_changes(saved, dict(saved)) == []
    touched = {**saved, "sources": {"files": [["/d/a.jsonl", 100, 2], ["/d/b.jsonl", 50, 2]]}}
    assert data_changes(saved, touched) == [], "same tokens: a touch is no change"
    now = {"train_sequences": 12, "train_digest": "b", "tokenizer": "byte:257:x",
           "sources": {"files": [["/d/a.jsonl", 120, 2], ["/d/c.jsonl", 5, 2]]}}  # fmt: skip
    assert data_changes(saved, now) == [
        "training sequences: 10 at the checkpoint, 12 now",
        "/d/b.jsonl: gone",
        "/d/c.jsonl: new (5 bytes)",
        "/d/a.jsonl: 100 bytes at the checkpoint, 120 now",
    ]
    retok = {**saved, "train_digest": "c", "tokenizer": "other:300:y"}
    assert data_changes(saved, retok)[:2] == [
        "the same number of training sequences (10) with other tokens",
        "tokenizer: byte:257:x at the checkpoint, other:300:y now",
    ]


def step_rows(n, world, micro, accum, epochs=3, seed=5, start=None):
    """Each optimizer step's rows (every rank's micro batches, as a set), as the loop takes them: each
    rank's micro batches epoch after epoch, accum of them a step; `start`: an (epoch, sample) to
    continue from, as a resume does."""
    first_epoch, first_sample = start or (0, 0)
    micros = [[] for _ in range(world)]  # each rank's micro batches, in order
    for epoch in range(first_epoch, epochs):
        for rank in range(world):
            s = RankSampler(n, rank, world, micro, seed, True, accum=accum)
            s.set_epoch(epoch, first_sample if epoch == first_epoch else 0)
            rows = list(s)
            micros[rank] += [rows[i : i + micro] for i in range(0, len(rows), micro)]
    steps = len(micros[0]) // accum
    return [{x for r in micros for m in r[k * accum : (k + 1) * accum] for x in m} for k in range(steps)]


def test_the_rows_of_each_step_depend_on_the_global_batch_only():
    """An elastic shrink keeps the global batch (4 ranks x accumulation 1 -> 2 ranks x 2): every step
    trains the same rows, epoch ends included. The rows an epoch drops are n mod the global batch (they
    were n mod world x micro: 4 x 1 dropped 3 of 103 rows, 2 x 2 one, and every later step shifted)."""
    n, micro = 103, 2  # global batch 8: 12 steps an epoch, 7 rows dropped
    four = step_rows(n, 4, micro, 1)
    two = step_rows(n, 2, micro, 2)
    one = step_rows(n, 1, micro, 4)
    assert len(four) == 3 * 12 and four == two == one
    # resumed mid-epoch at the other world size (the position is global: epoch 1, after 5 steps)
    assert step_rows(n, 2, micro, 2, start=(1, 5 * 8)) == four[12 + 5 :]
