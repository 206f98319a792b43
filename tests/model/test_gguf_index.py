"""The GGUF index cache (gguf_loader.GGUFFile): the first open parses the file with gguf's reader
and keeps its tables under $FERRYLM_CACHE_DIR/gguf; later opens read them instead (no reader), a
damaged index is rebuilt, and the model loaded through the index has the file's exact config."""

from __future__ import annotations

import gguf
import numpy as np

from ferrylm.model.loaders.gguf_loader import GGUFFile, load_gguf_config
from ferrylm.model.loaders.model_source import resolve_model
from tests.conftest import requires_smollm2

pytestmark = requires_smollm2


def test_index_written_reused_and_rebuilt_when_damaged(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path))
    path = resolve_model("smollm2-135m").path
    first = GGUFFile(path)
    (index,) = (tmp_path / "gguf").glob("*.json")
    readers = []

    def counting_reader(*args, **kwargs):
        readers.append(real_reader(*args, **kwargs))
        return readers[-1]

    real_reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    again = GGUFFile(path)
    assert readers == []  # served from the index
    assert again.tensors == first.tensors
    assert load_gguf_config(again, "m") == load_gguf_config(first, "m")
    assert again.field_len("tokenizer.ggml.tokens") == 49152 and again.field("tokenizer.ggml.tokens") is None
    index.write_text('{"version": 1, "fields"')  # damaged (a crash mid-write cannot do this: os.replace)
    rebuilt = GGUFFile(path)
    assert len(readers) == 1 and rebuilt.tensors == first.tensors
    assert index.read_text().startswith('{"version": 1')
    for t in again.tensors[:5]:  # the bytes served through the index are the reader's
        want = next(r for r in readers[0].tensors if r.name == t.name)
        assert np.array_equal(np.asarray(want.data).reshape(-1).view(np.uint8), again.data(t))

def test_an_unwritable_cache_still_loads(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(blocker))
    assert GGUFFile(resolve_model("smollm2-135m").path).field("general.architecture") == "llama"

