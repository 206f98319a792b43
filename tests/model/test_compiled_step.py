"""The compiled CPU decode step (model/compile/compiled_step.py) on a tiny random Llama in bf16: the same
greedy tokens as eager mode over batch sizes that hit both graphs (also with an fp8 KV cache), a
restart that loads the compiled graphs from the disk cache instead of compiling, and enforce_eager
turning it off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ferrylm.config import CacheConfig, EngineConfig, SchedulerConfig
from ferrylm.model.attention.cpu_kernels import load_cpu_kernels
from ferrylm.model.loaders.loader import Checkpoint
from ferrylm.model.loaders.model_source import resolve_model
from ferrylm.model.parallel.tp_worker import build_runner
from ferrylm.model.runner import ModelRunner
from ferrylm.sampling_params import SamplingParams
from ferrylm.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from tests.model.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="C++ toolchain unavailable: nothing compiles")

BLOCK, BLOCKS_PER_SEQ, MAX_SEQS, MAX_LEN = 16, 4, 4, 64

RUNNER_SCRIPT = """
import json, sys
import torch
from ferrylm.config import CacheConfig, EngineConfig, SchedulerConfig
from ferrylm.model.loaders.loader import Checkpoint
from ferrylm.model.loaders.model_source import resolve_model
from ferrylm.model.runner import ModelRunner
runner = ModelRunner(Checkpoint(resolve_model(sys.argv[1])), CacheConfig(block_size=16, num_blocks=32),
                     torch.bfloat16, torch.device("cpu"), 64, max_num_seqs=4, compile_in_background=False)
report = runner.compiled.report
print(json.dumps({"loaded": report.loaded, "compiled": report.compiled, "seconds": report.seconds}))
"""


def _runner(directory: Path, enforce_eager: bool, cache_dtype: str = "auto",
            max_num_seqs: int = MAX_SEQS, background: bool = False) -> ModelRunner:
    return ModelRunner(Checkpoint(resolve_model(str(directory))),
                       CacheConfig(block_size=BLOCK, num_blocks=32, cache_dtype=cache_dtype), torch.bfloat16,
                       torch.device("cpu"), MAX_LEN, max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
                       compile_in_background=background)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("compiled") / "tiny")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ferrylm-cache")


@pytest.fixture(scope="module")
def runners(tiny, cache_dir):
    """(compiled, eager) runners on the same checkpoint; the compiled one fills `cache_dir`."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FERRYLM_CACHE_DIR", str(cache_dir))
    try:
        compiled = _runner(tiny, enforce_eager=False)
    finally:
        mp.undo()
    assert compiled.compiled is not None, "the decode step did not compile (see the warning logged)"
    return compiled, _runner(tiny, enforce_eager=True)


def _greedy(runner: ModelRunner, prompts: list[list[int]], max_tokens: list[int], tag: str) -> list[list[int]]:
    """Prefill every prompt in one step, then decode until each has max_tokens; requests finish at
    different steps, so the decode batch shrinks as it goes. Disjoint block tables per request."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    tables = {rid: list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i, rid in enumerate(ids)}
    params = SamplingParams(temperature=0.0, max_tokens=max(max_tokens))
    out = {rid: [] for rid in ids}
    prefill = [ScheduledRequest(rid, p, 0, tables[rid], True) for rid, p in zip(ids, prompts)]
    sched = SchedulerOutput(prefill, [NewRequestData(rid, p, params) for rid, p in zip(ids, prompts)], [],
                            sum(map(len, prompts)))
    while sched.scheduled:
        for rid, token in runner.execute(sched).sampled.items():
            out[rid].append(token)
        live = [(rid, p, n) for rid, p, n in zip(ids, prompts, max_tokens) if len(out[rid]) < n]
        step = [ScheduledRequest(rid, [out[rid][-1]], len(p) + len(out[rid]) - 1, tables[rid], True)
                for rid, p, _ in live]
        done = [rid for rid, _, n in zip(ids, prompts, max_tokens) if len(out[rid]) == n]
        sched = SchedulerOutput(step, [], done, len(step))
    return [out[rid] for rid in ids]


def test_compiled_tokens_equal_eager(runners, monkeypatch):
    compiled, eager = runners
    calls: list[int] = []
    step = compiled.compiled
    original = step.logits
    monkeypatch.setattr(step, "logits", lambda batch: calls.append(batch.num_seqs) or original(batch))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 17, 30, 1)]
    cases = [(prompts[:1], [12]), (prompts, [9, 14, 4, 11]), (prompts[1:3], [6, 6])]
    for i, (group, max_tokens) in enumerate(cases):
        want = _greedy(eager, group, max_tokens, f"e{i}")
        got = _greedy(compiled, group, max_tokens, f"c{i}")
        assert got == want
    # Every decode step went through a compiled graph, none eagerly: 11 steps of 1 row; 3 of 4, 5 of
    # 3, 2 of 2 and 3 of 1 as the four requests finish; 5 of 2. Sizes 1 (its own graph) and 2..4.
    assert len(calls) == 11 + 13 + 5
    assert set(calls) == {1, 2, 3, 4}


def test_repeated_sizes_call_the_graph_on_its_flat_inputs(runners, monkeypatch):
    """After a batch size's first step, its graph is called on the flat inputs gathered then (flat_call):
    dynamo's bytecode, which gathers them again from the modules, is not run, and every later step still
    reads its own refilled inputs (the tokens equal eager mode's)."""
    compiled, eager = runners
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (7, 3, 12)]
    _greedy(compiled, prompts, [5, 5, 5], "warm")  # sizes 3 (graph 2..4) captured
    _greedy(compiled, prompts[:1], [3], "warm1")  # size 1 captured

    def no_bytecode(*args, **kwargs):
        raise AssertionError("dynamo's bytecode ran for a batch size already captured")

    for size_range in compiled.compiled.ranges:
        monkeypatch.setattr(size_range.step, "fn", no_bytecode)
    for i, (group, max_tokens) in enumerate([(prompts, [6, 6, 6]), (prompts[1:2], [8])]):
        assert _greedy(compiled, group, max_tokens, f"flat{i}") == _greedy(eager, group, max_tokens, f"eflat{i}")


def _mixed(runner: ModelRunner, tag: str) -> tuple[list[int], list[int], list]:
    """Request A (7-token prompt) decodes while request B's 10-token prompt is prefilled 3 tokens a
    step beside it (4 rows: a compiled step's size), B scoring its prompt (prompt_logprobs=2); then
    both decode. (A's tokens, B's tokens, B's prompt logprobs)."""
    gen = torch.Generator().manual_seed(11)
    a, b = (torch.randint(3, 320, (n,), generator=gen).tolist() for n in (7, 10))
    ra, rb = f"{tag}-a", f"{tag}-b"
    ta, tb = list(range(0, BLOCKS_PER_SEQ)), list(range(BLOCKS_PER_SEQ, 2 * BLOCKS_PER_SEQ))
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    out_a: list[int] = []
    out_b: list[int] = []
    scored: list = []
    step = SchedulerOutput([ScheduledRequest(ra, a, 0, ta, True)], [NewRequestData(ra, a, greedy)], [], len(a))
    out_a.append(runner.execute(step).sampled[ra])
    new = [NewRequestData(rb, b, SamplingParams(temperature=0.0, max_tokens=16, prompt_logprobs=2))]
    for start in range(0, len(b), 3):
        chunk = b[start:start + 3]
        items = [ScheduledRequest(ra, [out_a[-1]], len(a) + len(out_a) - 1, ta, True),
                 ScheduledRequest(rb, chunk, start, tb, start + len(chunk) == len(b))]
        result = runner.execute(SchedulerOutput(items, new, [], 1 + len(chunk)))
        new = []
        out_a.append(result.sampled[ra])
        scored += result.prompt_logprobs.get(rb, [])
        if rb in result.sampled:
            out_b.append(result.sampled[rb])
    for _ in range(4):
        items = [ScheduledRequest(ra, [out_a[-1]], len(a) + len(out_a) - 1, ta, True),
                 ScheduledRequest(rb, [out_b[-1]], len(b) + len(out_b) - 1, tb, True)]
        result = runner.execute(SchedulerOutput(items, [], [], 2))
        out_a.append(result.sampled[ra])
        out_b.append(result.sampled[rb])
    runner.execute(SchedulerOutput([], [], [ra, rb], 0))
    return out_a, out_b, scored


def test_prefill_chunks_beside_decodes_run_in_the_compiled_step(runners, monkeypatch):
    """A step whose tokens fit the compiled graphs lays each prefill chunk out as decode rows and runs
    in the graph (the eager mixed step cost ~3x the decode step it joined): the same greedy tokens as
    the eager runner, the prompt's logprobs from the graph's rows within bf16 rounding of eager's."""
    compiled, eager = runners
    calls: list[int] = []
    step = compiled.compiled
    original = step.logits
    monkeypatch.setattr(step, "logits", lambda batch: calls.append(batch.num_seqs) or original(batch))
    want_a, want_b, want_scored = _mixed(eager, "mix-e")
    got_a, got_b, got_scored = _mixed(compiled, "mix-c")
    assert (got_a, got_b) == (want_a, want_b)
    # the 4 mixed steps (3 + 3 + 3 + 1 prompt tokens beside A's decode) and the 4 decode steps
    assert calls == [4, 4, 4, 2, 2, 2, 2, 2], calls
    assert [p.position for p in got_scored] == list(range(1, 10))
    for got, want in zip(got_scored, want_scored, strict=True):
        assert got.position == want.position and list(got.entries)[0] == list(want.entries)[0]
        token = list(want.entries)[0]
        assert abs(got.entries[token] - want.entries[token]) < 0.05, (got, want)


def test_background_compile_serves_eagerly_then_takes_over(tiny, tmp_path, monkeypatch):
    """The default start: the constructor returns without compiling (a cold cache costs minutes on a
    slow CPU), the first step starts the compile on a thread, steps run eagerly meanwhile, and once
    ready the compiled step serves decode rows, with the same tokens throughout."""
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path))
    runner = _runner(tiny, enforce_eager=False, max_num_seqs=1, background=True)
    assert runner._compiling is not None and runner.compiled is None, "the constructor waited for the compile"
    assert runner._compiling.ident is None, "the compile started before the first step (it slows the start)"
    eager = _runner(tiny, enforce_eager=True, max_num_seqs=1)
    prompt = torch.randint(3, 320, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    want = _greedy(eager, [prompt], [10], "bg-e")
    assert _greedy(runner, [prompt], [10], "bg-0") == want  # served now, compiled or not
    assert runner._compiling.ident is not None  # the first step started it
    step = runner.wait_compiled(timeout=900)
    assert step is not None and runner.compiled is step
    calls: list[int] = []
    original = step.logits
    monkeypatch.setattr(step, "logits", lambda batch: calls.append(batch.num_seqs) or original(batch))
    assert _greedy(runner, [prompt], [10], "bg-1") == want
    assert calls == [1] * 9  # every decode step through the graph once it was ready


def test_the_default_start_compiles_in_a_child_process_and_only_loads_the_graphs(tiny, tmp_path, monkeypatch):
    """build_runner's runner (what `ferrylm serve` and LLM() use) hands a cold cache's compile to a
    child process (compile_worker.py): steps run eagerly meanwhile, and this process then loads
    every graph the child saved instead of compiling any (the keys match), same tokens throughout."""
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path))
    config = EngineConfig(model=str(tiny), dtype="bfloat16", cache=CacheConfig(block_size=BLOCK, num_blocks=32),
                          scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=MAX_LEN))
    runner, _, _ = build_runner(config)
    assert runner.compile_elsewhere is not None and runner._compiling.ident is None
    eager = _runner(tiny, enforce_eager=True, max_num_seqs=1)
    prompt = torch.randint(3, 320, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    want = _greedy(eager, [prompt], [10], "child-e")
    assert _greedy(runner, [prompt], [10], "child-0") == want
    step = runner.wait_compiled(timeout=900)
    assert step is not None and step.report is not None
    assert step.report.compiled == [] and step.report.loaded == ["1"], step.report
    assert list((tmp_path / "compiled").glob("*/decode-*.bin")), "the child saved no graph"
    calls: list[int] = []
    original = step.logits
    monkeypatch.setattr(step, "logits", lambda batch: calls.append(batch.num_seqs) or original(batch))
    assert _greedy(runner, [prompt], [10], "child-1") == want
    assert calls == [1] * 9
    # a warm cache needs no child: the next start loads at once
    again, _, _ = build_runner(config)
    again.compile_elsewhere = lambda: pytest.fail("a warm cache started the compile worker")
    assert again.wait_compiled(timeout=300).report.loaded == ["1"]


def test_compiled_fp8_kv_step_equals_eager(tiny, tmp_path, monkeypatch):
    """With --kv-cache-dtype fp8 the C++ quantizing KV write is traced into the graph; one sequence
    (one graph to compile), the same tokens as eager fp8."""
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path))
    compiled = _runner(tiny, enforce_eager=False, cache_dtype="fp8", max_num_seqs=1)
    assert compiled.compiled is not None, "the decode step did not compile with an fp8 KV cache"
    eager = _runner(tiny, enforce_eager=True, cache_dtype="fp8", max_num_seqs=1)
    gen = torch.Generator().manual_seed(1)
    for i, n in enumerate((7, 21)):
        prompt = torch.randint(3, 320, (n,), generator=gen).tolist()
        assert _greedy(compiled, [prompt], [12], f"c8-{i}") == _greedy(eager, [prompt], [12], f"e8-{i}")


def test_restart_loads_the_compile_cache(runners, tiny, cache_dir):
    compiled, _ = runners
    assert compiled.compiled.report.compiled == ["2-4", "1"]  # a fresh cache: both compiled
    files = {p: p.stat().st_mtime_ns for p in (cache_dir / "compiled").glob("*/decode-*.bin")}
    assert len(files) == 2
    env = {**os.environ, "FERRYLM_CACHE_DIR": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-c", RUNNER_SCRIPT, str(tiny)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["compiled"] == [] and report["loaded"] == ["2-4", "1"], proc.stderr[-3000:]
    assert report["seconds"] < compiled.compiled.report.seconds  # loading beats compiling
    assert {p: p.stat().st_mtime_ns for p in (cache_dir / "compiled").glob("*/decode-*.bin")} == files


def test_enforce_eager_compiles_nothing(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path))
    runner = _runner(tiny, enforce_eager=True)
    assert runner.compiled is None
    assert not (tmp_path / "compiled").exists()
    out = _greedy(runner, [[5, 6, 7]], [3], "x")
    assert len(out[0]) == 3


def test_enforce_eager_flag_reaches_the_engine_config():
    import argparse

    from ferrylm.cli import _add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    _add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--enforce-eager"])).enforce_eager is True
