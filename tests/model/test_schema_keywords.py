"""Every draft 2020-12 keyword the schema policy lets through (schema_policy.ENFORCED) is really
enforced by the grammar backend: compile a schema using it, walk the grammar with random allowed
tokens (seeded) until it may end, and validate what came out with `jsonschema`. A keyword that
fails here must move out of ENFORCED (and become a 400)."""

from __future__ import annotations

import json
import os
import random

import pytest

from ferrylm.model.structured.schema_policy import ENFORCED
from tests.conftest import requires_smollm2

# ~20 s per keyword on 2 cores: run with FERRYLM_KEYWORD_PROBE=1 when xgrammar or the policy changes
pytestmark = [requires_smollm2, pytest.mark.skipif(os.environ.get("FERRYLM_KEYWORD_PROBE") != "1",
                                                   reason="slow: FERRYLM_KEYWORD_PROBE=1")]
CASES = {
    "multipleOf": {"type": "integer", "multipleOf": 7},
    "minimum": {"type": "integer", "minimum": 5}, "maximum": {"type": "number", "maximum": 1.5},
    "exclusiveMinimum": {"type": "integer", "exclusiveMinimum": 5},
    "exclusiveMaximum": {"type": "integer", "exclusiveMaximum": 5},
    "minLength": {"type": "string", "minLength": 3}, "maxLength": {"type": "string", "maxLength": 3},
    "pattern": {"type": "string", "pattern": "^a[bc]+$"}, "format": {"type": "string", "format": "date"},
    "enum": {"enum": ["x", 1, None]}, "const": {"const": {"a": 1}}, "type": {"type": ["integer", "null"]},
    "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    "prefixItems": {"type": "array", "prefixItems": [{"const": 1}, {"type": "string", "maxLength": 2}],
                    "items": False},
    "minItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    "maxItems": {"type": "array", "items": {"type": "integer"}, "maxItems": 1},
    "properties": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                   "additionalProperties": False},
    "required": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"}},
                 "required": ["b"], "additionalProperties": False},
    "additionalProperties": {"type": "object", "additionalProperties": {"type": "integer"}, "maxLength": 0},
    "anyOf": {"anyOf": [{"type": "integer", "maximum": 3}, {"type": "string", "maxLength": 2}]},
    "allOf": {"allOf": [{"type": "integer", "minimum": 0, "maximum": 5}]},  # one branch: all that is accepted
    "$ref": {"$defs": {"p": {"type": "integer", "maximum": 3}}, "$ref": "#/$defs/p"},
}


@pytest.fixture(scope="module")
def backend():
    import xgrammar

    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model("smollm2-135m"))
    info = xgrammar.TokenizerInfo.from_huggingface(tok.hf, vocab_size=len(tok.hf),
                                                   stop_token_ids=list(tok.eos_token_ids))
    return tok, xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _walk(tok, compiled, rng: random.Random, steps: int = 48) -> str | None:
    """Random allowed tokens until the grammar may end (then stop half the time); None if it never did."""
    import torch
    import xgrammar
    import xgrammar.testing

    matcher = xgrammar.GrammarMatcher(compiled)
    size = len(tok.hf)
    bitmask = xgrammar.allocate_token_bitmask(1, size)
    eos = torch.tensor(sorted(tok.eos_token_ids))
    out: list[int] = []
    for _ in range(steps):
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = xgrammar.testing.bitmask_to_bool_mask(bitmask, size)[0][:size]
        may_end = bool(allowed[eos].any())
        allowed[eos] = False
        ids = torch.nonzero(allowed).flatten()
        if may_end and (rng.random() < 0.5 or len(ids) == 0):
            return tok.hf.decode(out)
        token = int(ids[rng.randrange(len(ids))])
        assert matcher.accept_token(token)
        out.append(token)
    return None


def test_the_cases_cover_every_enforced_keyword():
    assert ENFORCED - set(CASES) <= {"$defs", "definitions"}


@pytest.mark.parametrize("keyword", sorted(CASES))
def test_generated_output_validates(backend, keyword):
    import jsonschema

    tok, compiler = backend
    schema = CASES[keyword]
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    rng = random.Random(keyword)
    finished = [text for text in (_walk(tok, compiled, rng) for _ in range(4)) if text is not None]
    assert finished, "no sample ended within the step bound"
    for text in finished:
        assert validator.is_valid(json.loads(text)), (keyword, text)
