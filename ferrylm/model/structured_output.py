"""Structured output through xgrammar: a request's constraint (StructuredOutputsParams) compiled to a
grammar off the engine thread, one matcher per request, and each step's logits masked to the tokens
the grammar allows next.

Compiling runs on one worker thread with a cache keyed by the constraint, so an uncached schema never
stalls the batch (the scheduler admits a request once its future is done). xgrammar is imported on
the first structured request, not at start-up: the import alone takes seconds.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ferrylm.sampling_params import StructuredOutputsParams

log = logging.getLogger("ferrylm.structured_output")

# JSON Schema keywords xgrammar accepts but does not enforce: a schema using one is refused (400)
# rather than answered with output that may break it. uniqueItems is refused only when true.
_UNENFORCED = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies", "contains",
               "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name → subschema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems")
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled or enforced; `param` names the request field (a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_schema(schema: Any, where: str = "#") -> None:
    """Raise for the first keyword the grammar would not enforce (see _UNENFORCED) or an external $ref."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_schema(item, f"{where}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for keyword in _UNENFORCED:
        if keyword in schema:
            raise ValueError(f"the JSON schema keyword '{keyword}' (at {where}) is not supported by the "
                             "structured output backend")
    if schema.get("uniqueItems") is True:
        raise ValueError(f"'uniqueItems': true (at {where}) is not supported by the structured output backend")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise ValueError(f"only local '$ref's (#/...) are supported; {ref!r} at {where} is not")
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                check_schema(sub, f"{where}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            check_schema(schema[key], f"{where}/{key}")
    for key in _SCHEMA_ONE:
        if isinstance(schema.get(key), (dict, list)):
            check_schema(schema[key], f"{where}/{key}")


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are xgrammar's literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(error: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    return _XGRAMMAR_PREFIX.sub("", str(error).strip()).strip()


class GrammarCompiler:
    """Compiles constraints for one tokenizer on a worker thread; the futures are cached (LRU).

    `submit` is thread-safe: the server calls it from the event loop to answer a bad schema with a
    400 before the request reaches the engine, and the engine calls it again (a cache hit)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], max_cached: int = 256):
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built on the worker at first use
        self.compile_seconds: dict[tuple, float] = {}  # per cached key: cold compile time (benchmarks)

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of `spec` (a Future; its exception is a StructuredOutputError)."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                return future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="ferrylm-grammar")
            future = self._executor.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self._max_cached:
                old, _ = self._cache.popitem(last=False)
                self.compile_seconds.pop(old, None)
            return future

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        started = time.perf_counter()
        try:
            compiled = self._compile_kind(self._xgrammar_compiler(), spec)
        except (RuntimeError, ValueError) as e:
            raise StructuredOutputError(f"Invalid '{spec.param}': {_clean(e)}", spec.param) from None
        except ImportError:
            raise StructuredOutputError("structured output needs xgrammar (pip install 'ferrylm[server]')",
                                        spec.param) from None
        self.compile_seconds[spec.key()] = time.perf_counter() - started
        return compiled

    @staticmethod
    def _compile_kind(compiler: Any, spec: StructuredOutputsParams) -> Any:
        if spec.json is not None:
            try:
                schema = json.loads(spec.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            check_schema(schema)
            return compiler.compile_json_schema(spec.json, any_whitespace=not spec.disable_any_whitespace)
        if spec.json_object:  # OpenAI's json_object: any JSON object (not any JSON value)
            return compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                any_whitespace=not spec.disable_any_whitespace)
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_grammar(choice_grammar(spec.choice))
        return compiler.compile_grammar(spec.grammar)

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:  # only the one worker thread gets here
            started = time.perf_counter()
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self._vocab_size,
                                                           stop_token_ids=self._stop_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            log.info("structured output backend (xgrammar) ready in %.1f s", time.perf_counter() - started)
        return self._compiler

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def new_matcher(compiled: Future) -> Any:
    """A request's matcher over its (already compiled) grammar."""
    import xgrammar

    return xgrammar.GrammarMatcher(compiled.result())


def apply_grammar_masks(logits: Any, rows: list[int], matchers: list[Any]) -> None:
    """Set to -inf, in place, every logit the matcher of row rows[j] forbids (other rows untouched)."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, matcher in zip(rows, matchers):
        matcher.fill_next_token_bitmask(bitmask, row)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)


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
