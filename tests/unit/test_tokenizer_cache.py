"""The converted-tokenizer cache of a GGUF: written once, a damaged entry rebuilt, and never a
temporary directory left behind (earlier builds left one per process that lost the race to write)."""

from __future__ import annotations

import json

from ferrylm.model.loaders.model_source import resolve_model
from ferrylm.tokenizer import Tokenizer, _cache_dir
from tests.conftest import requires_smollm2

pytestmark = requires_smollm2


def test_cache_is_written_rebuilt_when_damaged_and_leaves_no_temp_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path))
    source = resolve_model("smollm2-135m")
    cache = _cache_dir(source)
    want = Tokenizer.load(source).encode("Hello, world!")
    assert (cache / "tokenizer.json").is_file() and [p.name for p in cache.parent.iterdir()] == [cache.name]
    (cache / "tokenizer.json").write_text("{damaged")
    assert Tokenizer.load(source).encode("Hello, world!") == want
    json.loads((cache / "tokenizer.json").read_text())  # repaired, not left damaged
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]
    assert Tokenizer.load(source).encode("Hello, world!") == want  # now read from the cache


def test_a_gguf_of_an_architecture_transformers_cannot_read_still_gives_its_vocabulary(tmp_path, monkeypatch):
    """transformers' GGUF reader refuses arch `llama4` outright; the file's tokenizer fields do not
    depend on it: the same vocabulary in a llama4 file encodes, decodes and templates as SmolLM2's."""
    from ferrylm.tokenizer_gguf import vocab_only_copy

    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path / "cache"))
    smol = resolve_model("smollm2-135m")
    path = vocab_only_copy(smol.path, tmp_path / "llama4.gguf", "llama4")  # SmolLM2's vocabulary, arch llama4
    want, got = Tokenizer.load(smol), Tokenizer.load(resolve_model(str(path)))
    text = "Ferries dock at 9:30 — ünïcode, tabs\tand  spaces."
    assert got.encode(text) == want.encode(text) and got.decode(got.encode(text)) == want.decode(want.encode(text))
    assert got.vocab_size == want.vocab_size and got.eos_token_ids == want.eos_token_ids
    assert got.hf.chat_template == want.hf.chat_template
    assert not list((tmp_path / "cache" / "tokenizers").glob("tmp*"))  # the vocabulary-only copy is gone
