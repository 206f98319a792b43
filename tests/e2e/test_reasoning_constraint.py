"""A structured-output constraint under --reasoning-parser applies to the answer, not the thinking
(vLLM's default): a tiny model whose seeded sampled output is known, with a word of it renamed
`</think>`, thinks exactly as it does unconstrained (the same tokens: the gate leaves the logits alone),
closes its thinking, and then answers one of the `choice` words; the response splits the two."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.server_process import ServerProcess
from tests.model.tiny_models import make_tiny_model

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
ASK = [{"role": "user", "content": "t20 t21 t22 t23"}]


def word_tokenizer(directory: Path, names: dict[int, str], vocab_size: int = 320) -> Path:
    """The tiny models' word tokenizer (token i is "t{i}") with some tokens renamed, and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {names.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(directory))
    return directory


def _serve(model: Path, *extra: str) -> ServerProcess:
    server = ServerProcess("--model", str(model), "--served-model-name", "tiny", "--dtype", "float32", *extra)
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """(model directory, the unconstrained words (seeded), the index of the one renamed </think>)."""
    model = make_tiny_model("llama", tmp_path_factory.mktemp("reasoning-gate") / "m")
    word_tokenizer(model, {})
    server = _serve(model)
    try:
        out = server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=1.0,
                                                      seed=1234, extra_body={"ignore_eos": True})
    finally:
        assert server.stop() == 0
    words = out.choices[0].message.content.split()
    ids = [int(w[1:]) for w in words]
    prompt = {int(w[1:]) for w in ASK[0]["content"].split()}
    cut = next((i for i in range(1, len(ids)) if ids[i] not in {*ids[:i], *prompt, 0, 1, 2, 5, 6, 7, 8, 9}), None)
    assert cut is not None, words
    word_tokenizer(model, {ids[cut]: "</think>"})
    return model, words, cut


@pytest.fixture(scope="module")
def r1(thinking):
    """A deepseek_r1 server on the model whose </think> is known (constraints: the answer only)."""
    server = _serve(thinking[0], "--reasoning-parser", "deepseek_r1")
    yield server
    assert server.stop() == 0


def test_the_constraint_starts_after_the_thinking(thinking, r1):
    _, words, cut = thinking
    choices = ["t7", "t9"]
    out = r1.client().chat.completions.create(
        model="tiny", messages=ASK, max_tokens=12, temperature=1.0, seed=1234, extra_body={"structured_outputs": {
            "choice": choices}})
    message = out.choices[0].message.model_dump()
    assert message["reasoning"].split() == words[:cut]  # unconstrained: the same tokens as without a constraint
    assert message["content"].strip() in choices


def test_enable_in_reasoning_constrains_from_the_first_token(thinking):
    model, _, _ = thinking
    server = _serve(model, "--reasoning-parser", "deepseek_r1", "--structured-outputs-config",
                    '{"enable_in_reasoning": true}')
    try:
        out = server.client().chat.completions.create(
            model="tiny", messages=ASK, max_tokens=12, temperature=1.0, seed=1234,
            extra_body={"structured_outputs": {"regex": "t7</think>t9"}})  # tokens' bytes, no spaces
    finally:
        assert server.stop() == 0
    message = out.choices[0].message.model_dump()
    assert (message["reasoning"].strip(), message["content"].strip()) == ("t7", "t9")


def test_a_bad_structured_outputs_config_stops_the_start(tmp_path):
    server = ServerProcess("--structured-outputs-config", '{"backend": "xgrammar"}')
    assert server.proc.wait(120) == 2 and "backend not supported" in server.log_tail()
    server.stop()


def test_a_prompt_that_closed_the_thinking_is_answered_under_the_constraint(r1):
    """The prompt's last tag is </think> (a template that turns thinking off, or an assistant prefill):
    the output is all answer, constrained from its first token, and comes back as content."""
    out = r1.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "t5 t6 </think> t8"}], max_tokens=12,
        temperature=1.0, seed=1234, extra_body={"structured_outputs": {"choice": ["t7", "t9"]}})
    message = out.choices[0].message.model_dump()
    assert message["content"].strip() in ("t7", "t9") and not message.get("reasoning")
