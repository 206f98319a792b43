"""A GGUF's vocabulary for an architecture transformers' GGUF reader does not know (llama4, say).

The `tokenizer.*` fields of a GGUF file do not depend on the model's architecture, but transformers
refuses to read them from a file whose `general.architecture` it has no config mapping for. This
writes a vocabulary-only copy (no tensors: kilobytes to a few MB, whatever the model's size) that
names itself `llama`, whose converter reads both SentencePiece (`tokenizer.ggml.model` llama) and
BPE (gpt2) vocabularies, as it does for every llama-arch file.
"""

from __future__ import annotations

from pathlib import Path

PROXY_ARCHITECTURE = "llama"


def vocab_only_copy(source: Path, target: Path, architecture: str = PROXY_ARCHITECTURE) -> Path:
    """`source`'s general.* and tokenizer.* fields in a new GGUF at `target`, naming `architecture`."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), architecture)  # writes general.architecture itself
    for field in reader.fields.values():
        if field.name == "general.architecture" or not field.name.startswith(("general.", "tokenizer.")):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, field.contents(), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
