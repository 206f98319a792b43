"""Structured output inside the engine on the real model: the mask touches only the rows that have a
grammar, a grammar that is still compiling holds back only its own request, and one that fails after
the request was queued aborts that request alone (its KV blocks freed)."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import Future

import pytest

from ferrylm.config import SchedulerConfig
from ferrylm.engine.block_manager import BlockManager
from ferrylm.engine.request import Request
from ferrylm.engine.scheduler import RequestRejected, Scheduler
from ferrylm.model.structured.schema_policy import check_schema
from ferrylm.model.structured.structured_output import StructuredOutputError, choice_grammar
from ferrylm.outputs import FinishReason
from ferrylm.sampling_params import SamplingParams, SamplingParamsError
from ferrylm.sampling_params import StructuredOutputsParams as Spec
from tests.conftest import requires_smollm2

PROMPTS = ["The capital of France is", "List three fruits:", "Once upon a time"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rank": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "rank"]}


def test_schema_check_reads_keywords_not_property_names() -> None:
    check_schema({"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}})
    with pytest.raises(ValueError, match="'not'.*#/properties/a"):
        check_schema({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    with pytest.raises(ValueError, match="local"):
        check_schema({"$defs": {"x": {"$ref": "https://example.com/s.json"}}})
    assert choice_grammar(("a", 'say "b"')) == 'root ::= "a" | "say \\"b\\""'


def test_spec_needs_exactly_one_constraint_and_no_min_tokens() -> None:
    with pytest.raises(SamplingParamsError, match="exactly one"):
        Spec(regex="a", choice=("a",))
    with pytest.raises(SamplingParamsError, match="exactly one"):
        Spec()
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(min_tokens=2, structured_outputs=Spec(regex="a+"))
    assert info.value.param == "min_tokens"
    assert Spec(json={"b": 1, "a": 2}).json == '{"b": 1, "a": 2}'  # key order is the output's order


def test_scheduler_passes_over_a_request_whose_grammar_compiles() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), BlockManager(32, 4, True), 128)
    pending: Future = Future()
    params = SamplingParams(temperature=0, max_tokens=4)
    spec = Spec(regex="a+")
    first = Request("guided", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec), 4, 0.0,
                    grammar=pending)
    second = Request("plain", [4, 5, 6], params, 4, 1.0)
    failed: Future = Future()
    failed.set_exception(StructuredOutputError("bad", "structured_outputs"))
    s.add_request(first)
    s.add_request(second)
    s.add_request(Request("failed", [7, 8], params, 4, 2.0, grammar=failed))  # the engine aborts it
    assert [r.request_id for r in s.schedule().scheduled] == ["plain"]
    pending.set_result(object())
    out = s.schedule()
    assert [r.request_id for r in out.scheduled] == ["plain", "guided"]  # never "failed"
    assert out.new_requests[0].grammar == spec.ref()  # the grammar's reference: plain data, not the future
    s.check_invariants()


@requires_smollm2
def test_guided_rows_do_not_change_unguided_rows(llm_fp32) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].text for o in llm_fp32.generate(PROMPTS, greedy, use_tqdm=False)]
    guided = SamplingParams(temperature=0, max_tokens=40, structured_outputs=Spec(json=SCHEMA))
    choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs=Spec(choice=("yes", "no")))
    mixed = llm_fp32.generate(PROMPTS * 2 + ["Answer:"], [greedy] * 3 + [guided] * 3 + [choice], use_tqdm=False)
    assert [o.outputs[0].text for o in mixed[:3]] == alone
    for out in mixed[3:6]:
        assert out.outputs[0].finish_reason == FinishReason.STOP
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"city", "rank"} and len(value["city"]) <= 12 and 0 <= value["rank"] <= 99
    assert mixed[6].outputs[0].text in ("yes", "no")


class _LateFailure:
    """A compiler whose compile fails only after the request was queued (a direct engine user that
    did not wait for the compile, as the server does)."""

    def __init__(self) -> None:
        self.future: Future = Future()

    def submit(self, spec: Spec) -> Future:
        return self.future


@requires_smollm2
def test_grammar_failing_after_queueing_aborts_only_that_request(llm_fp32) -> None:
    engine = llm_fp32.engine
    real, late = engine.grammars, _LateFailure()
    engine.grammars = late
    try:
        guided = SamplingParams(temperature=0, max_tokens=8, structured_outputs=Spec(regex="(unclosed"))
        engine.add_request("bad", "Hello", guided)
        engine.add_request("good", "Hello", SamplingParams(temperature=0, max_tokens=4))
        finished: dict = {}
        for _ in range(8):
            finished |= {o.request_id: o for o in engine.step() if o.finished}
        assert "bad" not in finished and "good" in finished  # only the plain request advanced
        late.future.set_exception(StructuredOutputError("Invalid 'structured_outputs': bad regex",
                                                        "structured_outputs"))
        while engine.has_unfinished_requests():
            finished |= {o.request_id: o for o in engine.step() if o.finished}
        assert finished["bad"].outputs[0].finish_reason == FinishReason.ABORT
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        with pytest.raises(RequestRejected) as info:  # known to fail: refused at once
            engine.add_request("again", "Hello", guided)
        assert info.value.param == "structured_outputs"
    finally:
        engine.grammars = real
    engine.scheduler.check_invariants()


@requires_smollm2
def test_a_compile_past_its_budget_is_stopped_and_the_next_one_still_runs() -> None:
    """The compile runs in a worker process: past the budget it is killed and answered with an error
    naming the field; a compile nobody waits for any more is stopped; the compiler keeps serving."""
    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.model.structured.structured_output import GrammarCompiler, GrammarLimits
    from ferrylm.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model("smollm2-135m"))
    compiler = GrammarCompiler(tok.hf, len(tok.hf), tuple(tok.eos_token_ids), GrammarLimits(compile_timeout_s=30))
    try:
        assert compiler.submit(Spec(regex="[a-z]{3}")).result(60) is not None  # the worker is up
        compiler.limits = GrammarLimits(compile_timeout_s=0.001)
        slow = {"type": "object", "properties": {
            f"p{i}": {"type": "string", "pattern": "^[a-z]{2,9}@[a-z]{3,9}\\.com$"} for i in range(60)}}  # ~1 s
        with pytest.raises(StructuredOutputError, match="budget") as e:
            compiler.submit(Spec(json=slow, param="response_format")).result(60)
        assert e.value.param == "response_format"
        compiler.limits = GrammarLimits(compile_timeout_s=30)
        leaving = Spec(json=slow | {"title": "another key"})  # seconds to compile: released long before
        future = compiler.submit(leaving, waiting=True)
        compiler.release(leaving)  # the only waiter left
        with pytest.raises(StructuredOutputError):
            future.result(60)
        assert compiler.submit(Spec(choice=("yes", "no"))).result(60) is not None  # a fresh worker serves
    finally:
        compiler.shutdown()


def test_a_killed_compile_worker_is_replaced_by_a_ready_spare_before_the_next_compile() -> None:
    """After a worker is killed (budget, or nobody waiting) a spare starts in the background and
    reports ready (xgrammar imported, tokenizer loaded): the next compile takes it, so its budget is
    not spent on a process start (bench/compile_budget.py: a 1 s budget refused after 5.4 s before)."""
    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.model.structured.structured_output import GrammarCompiler, GrammarLimits
    from ferrylm.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model("smollm2-135m"))
    compiler = GrammarCompiler(tok.hf, len(tok.hf), tuple(tok.eos_token_ids), GrammarLimits(compile_timeout_s=0.5))
    # ~2 s of xgrammar on an AVX-512 Zen 4 (a literal "\\." in the pattern; the double-escaped "\\\\."
    # compiled in 0.05 s there and never met the budget)
    slow = {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": "^[a-z]{2,9}@[a-z]{3,9}\\.com$"} for i in range(120)}}
    try:
        with pytest.raises(StructuredOutputError, match="budget"):
            compiler.submit(Spec(json=slow)).result(120)  # the first worker: killed
        deadline = time.monotonic() + 120
        while not compiler._idle and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(compiler._idle) == 1, "no spare worker became ready"
        spare = compiler._idle[0]
        assert spare._ready and spare.alive
        started = time.monotonic()
        with pytest.raises(StructuredOutputError, match="budget"):
            compiler.submit(Spec(json=slow | {"title": "2"})).result(120)
        refused_after = time.monotonic() - started
        assert not spare.alive, "the second bomb did not run on the spare"
        assert refused_after < 0.5 + 3.0, refused_after  # a process start took 4-5 s more
        while not compiler._idle and time.monotonic() < deadline + 120:
            time.sleep(0.1)
        assert compiler.submit(Spec(choice=("yes", "no"))).result(60) is not None  # the next spare serves
    finally:
        compiler.shutdown()


@requires_smollm2
def test_a_compile_worker_runs_below_the_serving_threads() -> None:
    """A grammar worker at the engine's priority stretched 25 ms decode steps to seconds on a 2-core
    CPU (OpenMP barriers wait for a descheduled thread); it runs at nice +19, and so would inductor's
    compile pool below the decode-graph worker (same helper)."""
    import os

    import xgrammar

    from ferrylm.model.background_priority import NICENESS
    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.model.structured.grammar_worker import CompileWorker, tokenizer_info_json
    from ferrylm.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model("smollm2-135m"))
    info = xgrammar.TokenizerInfo.from_huggingface(tok.hf, vocab_size=len(tok.hf))
    worker = CompileWorker.spawn(tokenizer_info_json(info))
    try:
        worker.wait_ready()
        assert os.getpriority(os.PRIO_PROCESS, worker.pid) == NICENESS
        if sys.platform.startswith("linux"):
            assert os.sched_getscheduler(worker.pid) == os.SCHED_IDLE
        assert worker.compile("regex", "[a-z]{3}", True, 30.0, lambda: False)
    finally:
        started = time.monotonic()
        worker.kill()
    assert not worker.alive and time.monotonic() - started < 1.0  # reaped in the background, never waited on


@requires_smollm2
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the cap is Linux's RLIMIT_DATA")
def test_a_compile_past_its_memory_budget_is_refused_and_its_worker_keeps_serving() -> None:
    """The worker's data may grow by compile_memory_bytes past what it held when ready: past that the
    compile fails (xgrammar's std::bad_alloc) with a 400 naming the field, and the worker, still
    ready, serves the next compile: no process is killed and restarted for it."""
    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.model.structured.structured_output import GrammarCompiler, GrammarLimits
    from ferrylm.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model("smollm2-135m"))
    limits = GrammarLimits(compile_timeout_s=120, compile_memory_bytes=64 << 20)
    compiler = GrammarCompiler(tok.hf, len(tok.hf), tuple(tok.eos_token_ids), limits)
    big = {"type": "object", "properties": {  # ~850 MB and 4 s to compile uncapped on an AVX-512 Zen 4
        f"p{i}": {"type": "string", "pattern": "^[a-z]{2,9}@[a-z]{3,9}\\.com$"} for i in range(120)}}
    try:
        assert compiler.submit(Spec(regex="[a-z]{3}")).result(120) is not None  # the worker is up
        (worker,) = compiler._idle
        with pytest.raises(StructuredOutputError, match="64 MiB memory budget") as e:
            compiler.submit(Spec(json=big, param="response_format")).result(120)
        assert e.value.param == "response_format"
        assert compiler._idle == [worker] and worker.alive
        assert compiler.submit(Spec(choice=("yes", "no"))).result(60) is not None
        assert compiler._idle == [worker]
    finally:
        compiler.shutdown()


@requires_smollm2
def test_a_compile_whose_waiter_left_before_it_began_keeps_its_worker() -> None:
    """A request that leaves while its compile waits for a worker to start costs no process: the
    compile is dropped before it is sent, and the worker stays ready."""
    import xgrammar

    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.model.structured.grammar_worker import CompileCancelled, CompileWorker, tokenizer_info_json
    from ferrylm.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model("smollm2-135m"))
    info = xgrammar.TokenizerInfo.from_huggingface(tok.hf, vocab_size=len(tok.hf))
    worker = CompileWorker.spawn(tokenizer_info_json(info))
    try:
        with pytest.raises(CompileCancelled):
            worker.compile("regex", "[a-z]{3}", True, 30.0, lambda: True)
        assert worker.alive
        assert worker.compile("regex", "[a-z]{3}", True, 30.0, lambda: False)
    finally:
        worker.kill()


@requires_smollm2
def test_a_grammar_that_accepts_no_output_is_refused() -> None:
    """`root ::= root` compiles in xgrammar but allows no first token and no empty output: every mask
    would be empty and the model's tokens would all break it. It is a 400 naming the field; a
    grammar that only accepts the empty output, or some text, compiles."""
    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.model.structured.structured_output import GrammarCompiler
    from ferrylm.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model("smollm2-135m"))
    compiler = GrammarCompiler(tok.hf, len(tok.hf), tuple(tok.eos_token_ids))
    try:
        for grammar in ("root ::= root", "root ::= x\nx ::= x"):
            with pytest.raises(StructuredOutputError, match="accepts no output") as e:
                compiler.submit(Spec(grammar=grammar, param="structured_outputs")).result(120)
            assert e.value.param == "structured_outputs"
        assert compiler.submit(Spec(grammar='root ::= "a" | "b" root')).result(120) is not None
        assert compiler.submit(Spec(regex="a*")).result(120) is not None  # the empty output is allowed
    finally:
        compiler.shutdown()


@requires_smollm2
def test_a_grammar_dead_end_ends_the_request(llm_fp32) -> None:
    """`root ::= "a" x | "~~~~"; x ::= x` allows "a" and then nothing, not even a stop token (the grammar
    has a finite output, "~~~~", so it compiles; without one it is refused, test above): the request
    ends there with "stop" (EOS), its text "a", instead of sampling tokens that break it until
    max_tokens. The unguided row beside it is unchanged."""
    greedy = SamplingParams(temperature=0, max_tokens=6)
    alone = llm_fp32.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].text
    dead = SamplingParams(temperature=0, max_tokens=8,
                          structured_outputs=Spec(grammar='root ::= "a" x | "~~~~"\nx ::= x'))
    out = llm_fp32.generate(PROMPTS[:2], [greedy, dead], use_tqdm=False)
    assert out[0].outputs[0].text == alone
    assert out[1].outputs[0].text == "a" and out[1].outputs[0].finish_reason == FinishReason.STOP
