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
