"""Tokenizer.token_text: one id's text, decoded once (logprobs decode thousands of repeated ids)."""

from ferrylm.tokenizer import Tokenizer


class _CountingHF:
    eos_token_id = None

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], bool]] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls.append((ids, skip_special_tokens))
        kept = [i for i in ids if i or not skip_special_tokens]  # id 0 is the special one
        return "".join("<s>" if i == 0 else f"t{i}" for i in kept)


def test_token_text_keeps_special_tokens_and_decodes_each_id_once():
    hf = _CountingHF()
    tok = Tokenizer(hf, ())
    texts = [tok.token_text(i) for i in [5, 0, 5, 7, 0, 5]]
    assert texts == ["t5", "<s>", "t5", "t7", "<s>", "t5"]
    assert hf.calls == [([5], False), ([0], False), ([7], False)]
