"""OutputProcessor driven with the real Scheduler and a character tokenizer (no model): stop
strings finish requests through the scheduler, delta outputs add up to the cumulative ones,
logprobs arrive once, aborts end a request with an ABORT output."""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import pytest

from ferrylm.config import SchedulerConfig
from ferrylm.engine.block_manager import BlockManager
from ferrylm.engine.output_processor import OutputProcessor
from ferrylm.engine.request import Request
from ferrylm.engine.scheduler import Scheduler
from ferrylm.outputs import FinishReason, RequestOutput, RequestOutputKind
from ferrylm.sampling_params import SamplingParams

VOCAB = ["<eos>", "a", "b", "c", " ", "x", "y", "z", "é"]
EOS = 0
PROMPT = [1, 2, 3]
DELTA, CUMULATIVE = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE


class CharTokenizer:
    """Token i is the string VOCAB[i]; id 0 is special (what IncrementalDetokenizer calls)."""

    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        return [VOCAB[i] for i in ids if not (skip_special_tokens and i == EOS)]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)


class Logprobs(NamedTuple):
    entries: dict[int, float]


def ids(text: str) -> list[int]:
    return [VOCAB.index(ch) for ch in text]


class Harness:
    """Scheduler + OutputProcessor; each request emits its scripted tokens, one per step."""

    def __init__(self) -> None:
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                                   BlockManager(64, 4, True), 128)
        self.processor = OutputProcessor(SimpleNamespace(hf=CharTokenizer()), self.scheduler.finish_request)
        self.scripts: dict[str, list[int]] = {}

    def add(self, rid: str, tokens: list[int], kind: RequestOutputKind = CUMULATIVE, **params) -> Request:
        sp = SamplingParams(temperature=0, max_tokens=params.pop("max_tokens", len(tokens)), **params)
        req = Request(rid, list(PROMPT), sp, sp.max_tokens, 0.0, eos_token_ids=(EOS,))
        self.scheduler.add_request(req)
        self.processor.add_request(req, "abc", kind)
        self.scripts[rid] = list(tokens)
        return req

    def step(self, now: float = 1.0) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        sampled = {s.request_id: self.scripts[s.request_id].pop(0) for s in sched.scheduled if s.sample}
        logprobs = {rid: Logprobs({t: -0.25 * t, (t + 1) % len(VOCAB): -9.0}) for rid, t in sampled.items()}
        updated = self.scheduler.update(sched, sampled)
        outputs = self.processor.process(updated, logprobs, now)
        self.scheduler.check_invariants()
        return outputs

    def run(self) -> dict[str, list[RequestOutput]]:
        by_id: dict[str, list[RequestOutput]] = {}
        for now in range(1, 100):
            if not self.scheduler.has_unfinished:
                return by_id
            for out in self.step(float(now)):
                by_id.setdefault(out.request_id, []).append(out)
        raise AssertionError("did not finish")


def test_delta_outputs_add_up_to_the_cumulative_ones():
    h = Harness()
    tokens = ids("ab é xyz")
    h.add("cum", tokens, CUMULATIVE, logprobs=1)
    h.add("delta", tokens, DELTA, logprobs=1)
    outs = h.run()
    cum, delta = outs["cum"], outs["delta"]
    assert len(cum) == len(delta) == len(tokens)
    for step, c in enumerate(cum):  # after every step, not only at the end
        so_far = delta[:step + 1]
        assert c.outputs[0].text == "".join(d.outputs[0].text for d in so_far)
        assert c.outputs[0].token_ids == [t for d in so_far for t in d.outputs[0].token_ids]
        assert c.outputs[0].logprobs == [lp for d in so_far for lp in d.outputs[0].logprobs]
        assert c.outputs[0].cumulative_logprob == delta[step].outputs[0].cumulative_logprob
    final = cum[-1].outputs[0]
    assert final.text == "ab é xyz" and final.token_ids == tokens
    assert final.finish_reason is FinishReason.LENGTH and cum[-1].finished and delta[-1].finished
    assert all(len(d.outputs[0].token_ids) == len(d.outputs[0].logprobs) == 1 for d in delta)
    assert final.cumulative_logprob == pytest.approx(sum(-0.25 * t for t in tokens))
    assert cum[-1].prompt == "abc" and cum[-1].prompt_token_ids == PROMPT
    assert len(h.processor) == 0


def test_stop_string_finishes_the_request_through_the_scheduler():
    h = Harness()
    req = h.add("r", ids("abc xyz") + [1] * 10, DELTA, stop=["xy"], max_tokens=20)
    outs = h.run()["r"]
    assert "".join(o.outputs[0].text for o in outs) == "abc "
    last = outs[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == (FinishReason.STOP, "xy") and outs[-1].finished
    assert len(outs) == len("abc xy")  # no step after the stop string
    assert req.is_finished and "r" not in h.scheduler.requests and "r" not in h.processor
    assert h.scheduler.block_manager.num_free_blocks == h.scheduler.block_manager.num_blocks
    assert outs[-1].metrics.finished_time == float(len(outs))


def test_stop_string_included_when_asked():
    h = Harness()
    h.add("r", ids("abxyc"), CUMULATIVE, stop=["xy"], include_stop_str_in_output=True)
    assert h.run()["r"][-1].outputs[0].text == "abxy"


def test_text_held_for_a_stop_string_is_flushed_at_eos():
    h = Harness()
    h.add("r", ids("ab x") + [EOS], DELTA, stop=["xyz"], max_tokens=10)
    outs = h.run()["r"]
    assert outs[-2].outputs[0].text == ""  # "x" may start "xyz": held back
    assert outs[-1].outputs[0].text == "x" and outs[-1].outputs[0].finish_reason is FinishReason.STOP
    assert "".join(o.outputs[0].text for o in outs) == "ab x"


def test_no_logprobs_unless_asked():
    h = Harness()
    h.add("r", ids("ab"), DELTA)
    for out in h.run()["r"]:
        assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
def test_abort_mid_generation(kind):
    h = Harness()
    h.add("r", ids("abcabc"), kind, logprobs=0)
    h.step(1.0)
    h.step(2.0)
    h.scheduler.finish_request("r", FinishReason.ABORT)  # what Engine.abort does first
    out = h.processor.abort("r", now=3.0)
    c = out.outputs[0]
    assert out.finished and c.finish_reason is FinishReason.ABORT
    assert (c.text_delta, c.token_ids_delta) == ("", [])
    if kind is DELTA:  # everything was sent already
        assert (c.text, c.token_ids, c.logprobs) == ("", [], [])
    else:
        assert (c.text, c.token_ids, len(c.logprobs)) == ("ab", ids("ab"), 2)
    assert (out.metrics.first_token_time, out.metrics.last_token_time, out.metrics.finished_time) == (1.0, 2.0, 3.0)
    assert h.processor.abort("r") is None and h.processor.abort("unknown") is None
    assert len(h.processor) == 0
    h.scheduler.check_invariants()


def test_outputs_are_copies():
    """The consumer may hold an output while the engine keeps stepping (AsyncEngine's thread)."""
    h = Harness()
    h.add("r", ids("abc"), CUMULATIVE, logprobs=0)
    first = h.step(1.0)[0]
    h.step(2.0)
    assert first.outputs[0].token_ids == [1] and len(first.outputs[0].logprobs) == 1
    assert first.metrics.last_token_time == 1.0
