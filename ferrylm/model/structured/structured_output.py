"""Structured output through xgrammar: a request's constraint (StructuredOutputsParams) compiled to a
grammar off the engine thread, one matcher per request, and each step's logits masked to the tokens
the grammar allows next.

Compiling runs in bounded worker processes (grammar_worker.py) under a wall-clock budget, with a cache
keyed by the constraint, so an uncached schema never stalls the batch (the scheduler admits a request
once its future is done) and a compile bomb is killed instead of holding the compiler. xgrammar is
imported on the first structured request, not at start-up: the import alone takes seconds.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ferrylm.model.structured import grammar_fork_server
from ferrylm.model.structured.grammar_finite import has_finite_output
from ferrylm.model.structured.grammar_worker import (
    STARTUP_TIMEOUT_S,
    CompileCancelled,
    CompileOutOfMemory,
    CompileTimeout,
    CompileWorker,
    WorkerStartFailed,
    tokenizer_info_json,
)
from ferrylm.model.structured.schema_policy import SchemaLimits, check_schema
from ferrylm.sampling_params import StructuredOutputsParams

log = logging.getLogger("ferrylm.structured_output")

_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled or enforced; `param` names the request field (a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are xgrammar's literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(error: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    return _XGRAMMAR_PREFIX.sub("", str(error).strip()).strip()


@dataclass(frozen=True)
class GrammarLimits:
    """How much compiling one tenant's constraint may cost everyone: a wall-clock budget per compile
    (past it the compile is killed and the request gets a 400), the memory one compile may take (past
    it, a 400 too), compiles running at once (each in its own low-priority process), the
    compiled-grammar cache in bytes, and the schema limits."""

    compile_timeout_s: float = 5.0  # --grammar-compile-timeout
    compile_memory_bytes: int = 512 << 20  # --grammar-compile-memory (MiB there); 0: no cap
    max_concurrent: int = 2
    max_cache_bytes: int = 256 << 20
    max_cached: int = 256
    schema: SchemaLimits = SchemaLimits()


class _Job:
    """One constraint's compile: its future, and the waiters that still want it."""

    def __init__(self, spec: StructuredOutputsParams):
        self.future: Future[Any] = Future()
        self.spec, self.waiters, self.size = spec, 0, 0

    def cancelled(self) -> bool:
        return self.waiters <= 0 and not self.future.done()


class GrammarCompiler:
    """Compiles constraints for one tokenizer in worker processes (grammar_worker.py) under a budget;
    the futures are cached (LRU, bounded in bytes). `submit` is thread-safe: the server calls it
    from the event loop to answer a bad schema with a 400 before the request reaches the engine, and
    the engine calls it again (a cache hit). `release` says a waiter left; a compile nobody waits
    for is stopped."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 limits: GrammarLimits = GrammarLimits()):
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self.limits = limits
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, _Job] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self._info: Any = None  # xgrammar.TokenizerInfo, built at the first compile
        self._info_json = ""
        self._idle: list[CompileWorker] = []  # started and ready, each compiling nothing
        self._forks: grammar_fork_server.ForkServer | None = None  # where workers come from on Linux
        self._closed = False
        self._starting = 0  # spares being started (_start_spare)
        self._ready = threading.Condition(self._lock)  # notified when a worker becomes idle
        self.compile_seconds: dict[tuple, float] = {}  # per cached key: cold compile time (benchmarks)
        # StructuredOutputsParams.ref → the future a live request holds (alive while one does, even
        # once the LRU cache evicted it): what `compiled` resolves a SchedulerOutput's reference with
        self._live: weakref.WeakValueDictionary[str, Future] = weakref.WeakValueDictionary()

    def submit(self, spec: StructuredOutputsParams, waiting: bool = False) -> Future:
        """The compiled grammar of `spec` (a Future; its exception is a StructuredOutputError).
        `waiting`: the caller will `release` it when it stops waiting (a client that may leave)."""
        key = spec.key()
        with self._lock:
            job = self._cache.get(key)
            if job is not None and not job.future.cancelled():
                self._cache.move_to_end(key)
                job.waiters += 1 if waiting else 1 << 20  # the engine's own request never leaves early
            else:
                job = self._cache[key] = _Job(spec)
                job.waiters += 1 if waiting else 1 << 20
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self.limits.max_concurrent,
                                                        thread_name_prefix="ferrylm-grammar")
                self._executor.submit(self._run, job)
                self._evict()
            ref = spec.ref()
            known = self._live.get(ref)
            if known is None or not known.done() or known.cancelled() or known.exception() is not None:
                self._live[ref] = job.future  # a compiled one stays: requests scheduled with it use it
            return job.future

    def compiled(self, ref: str) -> Any:
        """The compiled grammar of a scheduled request's reference (its compile finished before the
        scheduler admitted it; KeyError if no live request holds it)."""
        return self._live[ref].result()

    def release(self, spec: StructuredOutputsParams) -> None:
        """A `submit(waiting=True)` caller stopped waiting (its client left)."""
        with self._lock:
            job = self._cache.get(spec.key())
            if job is not None:
                job.waiters -= 1
                if job.cancelled():
                    self._cache.pop(spec.key(), None)

    def _evict(self) -> None:
        """Oldest entries out while over the count or byte bound (caller holds the lock)."""
        while len(self._cache) > 1 and (len(self._cache) > self.limits.max_cached or
                                        sum(j.size for j in self._cache.values()) > self.limits.max_cache_bytes):
            old, _ = self._cache.popitem(last=False)
            self.compile_seconds.pop(old, None)

    def _run(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        started = time.perf_counter()
        try:
            compiled = self._compile(job)
            with self._lock:
                job.size = int(compiled.memory_size_bytes)
                self.compile_seconds[job.spec.key()] = time.perf_counter() - started
                self._evict()
        except StructuredOutputError as e:
            job.future.set_exception(e)
            return
        except BaseException as e:  # noqa: BLE001 - a future must always complete
            log.exception("grammar compile failed")
            job.future.set_exception(StructuredOutputError(f"Invalid '{job.spec.param}': {e}", job.spec.param))
            return
        job.future.set_result(compiled)

    def _compile(self, job: _Job) -> Any:
        spec, param = job.spec, job.spec.param
        try:
            kind, payload = self._checked(spec)
            import xgrammar

            info = self._tokenizer_info(xgrammar)
            text = self._on_worker(kind, payload, not spec.disable_any_whitespace, job)
            compiled = xgrammar.CompiledGrammar.deserialize_json(text, info)
            if _accepts_nothing(xgrammar, compiled, self._vocab_size):
                raise ValueError("the constraint accepts no output at all (no token may start it and it cannot be "
                                 "empty: its rules never reach a terminal)")
            if not has_finite_output(str(compiled.grammar)):
                raise ValueError("the constraint has no finite output: every derivation of its root recurses "
                                 "without end, so a request could only stop at max_tokens")
            return compiled
        except CompileTimeout:
            raise StructuredOutputError(f"Invalid '{param}': compiling it took longer than the "
                                        f"{self.limits.compile_timeout_s:g} s budget; simplify the constraint",
                                        param) from None
        except CompileOutOfMemory:
            raise StructuredOutputError(f"Invalid '{param}': compiling it needed more than the "
                                        f"{self.limits.compile_memory_bytes >> 20} MiB memory budget; simplify the "
                                        "constraint", param) from None
        except CompileCancelled:
            raise StructuredOutputError(f"'{param}': the compile was stopped (nobody waits for it)", param) from None
        except WorkerStartFailed:
            raise StructuredOutputError(f"'{param}': the structured-output compiler could not start; retry",
                                        param) from None
        except (RuntimeError, ValueError) as e:
            raise StructuredOutputError(f"Invalid '{param}': {_clean(e)}", param) from None
        except ImportError:
            raise StructuredOutputError("structured output needs xgrammar (pip install 'ferrylm[server]')",
                                        param) from None

    def _on_worker(self, kind: str, payload: str, any_whitespace: bool, job: _Job) -> str:
        """Compile on an idle worker process (the spare being started, if one is; else a new one); a
        worker that was killed is dropped and a spare started in its place, so the next compile does
        not wait for a whole process start."""
        with self._ready:
            if not self._idle and self._starting:
                self._ready.wait_for(lambda: self._idle or not self._starting, timeout=STARTUP_TIMEOUT_S)
            worker = self._idle.pop() if self._idle else None
        worker = worker or self._new_worker()
        try:
            return worker.compile(kind, payload, any_whitespace, self.limits.compile_timeout_s, job.cancelled)
        finally:
            if worker.alive:
                with self._ready:
                    self._idle.append(worker)
                    self._ready.notify()
            else:
                with self._lock:
                    self._starting += 1
                threading.Thread(target=self._start_spare, name="ferrylm-grammar-spare", daemon=True).start()

    def _new_worker(self) -> CompileWorker:
        """A worker forked from the fork server where the OS allows (milliseconds once that server is
        up), else one started afresh (seconds); WorkerStartFailed if neither can be had."""
        with self._lock:
            if self._closed:
                raise WorkerStartFailed()
            if self._forks is None and grammar_fork_server.supported():
                self._forks = grammar_fork_server.ForkServer(self._info_json, self.limits.compile_memory_bytes)
            forks = self._forks
        return forks.fork() if forks is not None else CompileWorker.spawn(self._info_json,
                                                                          self.limits.compile_memory_bytes)

    def _start_spare(self) -> None:
        """A ready worker into the idle list (at most max_concurrent idle; none after shutdown)."""
        worker = None
        try:
            worker = self._new_worker()
            worker.wait_ready()
        except (OSError, WorkerStartFailed):
            if not self._closed:  # after shutdown no worker may start: nothing failed
                log.warning("a spare grammar compile worker failed to start; the next compile starts one")
            worker = None
        with self._ready:
            self._starting -= 1
            keep = worker is not None and not self._closed and len(self._idle) < self.limits.max_concurrent
            if worker is not None and keep:
                self._idle.append(worker)
            self._ready.notify()
        if worker is not None and not keep:
            worker.kill()

    def _checked(self, spec: StructuredOutputsParams) -> tuple[str, str]:
        """(kind, payload) for the worker, after the limits and the keyword policy (ValueError)."""
        limits = self.limits.schema
        if spec.json is not None:
            try:
                schema = json.loads(spec.json)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            check_schema(schema, limits)
            return "json", spec.json
        if spec.json_object:
            return "json_object", ""
        if spec.regex is not None:
            if len(spec.regex.encode()) > limits.max_regex_bytes:
                raise ValueError(f"the regex is longer than {limits.max_regex_bytes} bytes")
            return "regex", spec.regex
        if spec.choice is not None:
            if len(spec.choice) > limits.max_choices or sum(map(len, spec.choice)) > limits.max_string_chars:
                raise ValueError(f"more than {limits.max_choices} choices or {limits.max_string_chars} characters")
            return "grammar", choice_grammar(spec.choice)
        assert spec.grammar is not None
        if len(spec.grammar.encode()) > limits.max_grammar_bytes:
            raise ValueError(f"the grammar is longer than {limits.max_grammar_bytes} bytes")
        return "grammar", spec.grammar

    def _tokenizer_info(self, xgrammar: Any) -> Any:
        with self._lock:
            if self._info is None:
                started = time.perf_counter()
                self._info = xgrammar.TokenizerInfo.from_huggingface(
                    self._hf_tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids)
                self._info_json = tokenizer_info_json(self._info)
                log.info("structured output backend (xgrammar) ready in %.1f s", time.perf_counter() - started)
            return self._info

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            forks, self._forks = self._forks, None
        for worker in idle:
            worker.kill()
        if forks is not None:
            forks.close()


def _accepts_nothing(xgrammar: Any, compiled: Any, vocab_size: int) -> bool:
    """No token is allowed first and the empty output is not accepted either (`root ::= root`): every
    step's mask would be empty and the model's tokens would all break the constraint."""
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return not bool(bitmask.any()) and not matcher.is_terminated()


def new_matcher(compiled: Any) -> Any:
    """A request's matcher over its compiled grammar (xgrammar.CompiledGrammar)."""
    import xgrammar

    return xgrammar.GrammarMatcher(compiled)


def apply_grammar_masks(logits: Any, rows: list[int], matchers: list[Any]) -> list[int]:
    """Set to -inf, in place, every logit the matcher of row rows[j] forbids (other rows untouched).
    Returns the rows whose grammar allows no token at all, not even a stop token: a dead end (its
    rules can never finish from here, e.g. `root ::= "a" x | "b"; x ::= x` after "a")."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, matcher in zip(rows, matchers):
        matcher.fill_next_token_bitmask(bitmask, row)
    dead = (bitmask[rows] == 0).all(dim=1).tolist()
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
    return [row for row, is_dead in zip(rows, dead) if is_dead]


def mask_draft_rows(logits: Any, first_row: int, matcher: Any, draft: list[int]) -> int:
    """Speculative verification of a guided request: row first_row + j of `logits` is masked, in place,
    with the grammar's state after draft[:j]. The walk stops at the first guess the grammar refuses
    (the target rejects it anyway) or at one that ends the grammar (nothing may follow it); the
    matcher is rolled back to where it was. Returns how many guesses stay: rows first_row ..
    first_row + that many are masked, the later ones are not to be used."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(draft) + 1, logits.shape[1])
    usable = steps = 0
    for j in range(len(draft) + 1):
        matcher.fill_next_token_bitmask(bitmask, j)
        if j == len(draft):
            break
        ok = matcher.accept_token(draft[j])
        steps += int(ok)
        if not ok or matcher.is_terminated():
            break
        usable = j + 1
    if steps:
        matcher.rollback(steps)
    rows = logits[first_row:first_row + usable + 1]
    xgrammar.apply_token_bitmask_inplace(rows, bitmask[:usable + 1].to(logits.device, non_blocking=True))
    return usable
