"""Greedy samples at each eval (train.eval_prompts) begin as the training rows do (issue 54): a chat prompt
is the template's rendering and nothing more, since data/chat.py tokenizes the rendering without special
tokens. The tokenizer's own BOS was put before it, so that under a template that renders no BOS (the
project's byte template over Llama 3.2's tokenizer, a user's template) the model was sampled on a prefix
it never trained on. Text prompts keep the BOS that packed text begins with."""

import pytest
import torch
from helpers import tokenizer_dir

from trainer import config
from trainer.data.examples import chat_profile
from trainer.data.templates import BYTE_TEMPLATE
from trainer.data.tokenizer import load_tokenizer, special_edges
from trainer.engine import complete


class Recorder:
    """An engine whose generate records the prompt ids it is given."""

    device = torch.device("cpu")

    def __init__(self):
        self.seen = []
        outer = self

        class Module:
            def generate(self, ids, **kw):
                outer.seen.append(ids[0].tolist())
                return ids

        class DS:
            module = Module()

            def train(self, mode):
                pass

        self.ds = DS()


@pytest.mark.parametrize("template", ["byte", "own"])
def test_a_chat_eval_prompt_begins_as_the_training_rows(tmp_path, template):
    tok = load_tokenizer(str(tokenizer_dir("llama3_2")))
    assert special_edges(tok)[0], "Llama 3.2's tokenizer adds a BOS"
    path = None
    if template == "byte":
        path = tmp_path / "t.jinja"
        path.write_text(BYTE_TEMPLATE)
    section = config.DataSection(train={"files": "x.jsonl", "kind": "chat"}, tokenizer=str(tokenizer_dir("llama3_2")),
                                 chat_template=str(path) if path else None,
                                 chat_template_kwargs={"date_string": "26 Jul 2024"})  # fmt: skip
    p = chat_profile(section, tok)
    question = "What does assert do?"
    row = tok(p.render(tok, [{"role": "user", "content": question}, {"role": "assistant", "content": "It checks."}]),
              add_special_tokens=False)["input_ids"]  # as data/chat.py tokenizes a training row  # fmt: skip
    prompt = p.render(tok, [{"role": "user", "content": question}], prompt=True)
    engine = Recorder()
    complete(engine, tok, [prompt], 4, synced=False, rendered=True)
    ids = engine.seen[0]
    assert row[: len(ids)] == ids, "the eval prompt is not the beginning of a training row"
    bos = tok.bos_token_id
    assert (ids[0] == bos) == (row[0] == bos)


def test_a_text_eval_prompt_keeps_the_bos_packed_text_begins_with():
    tok = load_tokenizer(str(tokenizer_dir("llama3_2")))
    engine = Recorder()
    complete(engine, tok, ["def "], 4, synced=False)
    assert (
        engine.seen[0][0] == tok.bos_token_id
        and engine.seen[0][1:] == tok("def ", add_special_tokens=False)["input_ids"]
    )
