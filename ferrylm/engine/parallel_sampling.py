"""Parallel sampling (n > 1), implemented once for the offline LLM and the server's Fanout.

The engine runs single sequences only: a request for n samples of one prompt becomes n child
requests, and their outputs are folded back into one RequestOutput whose outputs[i] is child i.
Children take the engine's deltas (RequestOutputKind.DELTA): each child's text, tokens and
logprobs are kept once here, instead of the engine copying them all at every step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ferrylm.outputs import PromptLogprobs, RequestOutput, RequestOutputKind
from ferrylm.sampling_params import SamplingParams


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Params of the index-th of n samples: n=1, and seed + index when the parent is seeded (the
    samples differ from each other, yet a seeded request still reproduces). Only the first sample
    scores the prompt (prompt_logprobs): the n share one prompt, so the others take its prefix
    cache instead of computing and scoring every position again."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if index == 0 else None)


@dataclass
class _ChildOutput:
    """One child's output so far, accumulated from its deltas."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    latest: RequestOutput | None = None  # the last delta (finish reason, metrics, cumulative logprob)
    prompt_logprobs: PromptLogprobs | None = None  # a DELTA carries them once

    def add(self, delta: RequestOutput) -> None:
        c = delta.outputs[0]
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text_parts.append(c.text)
        self.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(c.logprobs)
        self.latest = delta

    def cumulative(self, index: int) -> RequestOutput:
        if self.latest is None:
            raise ValueError("no output yet")
        c = self.latest.outputs[0]
        completion = dataclasses.replace(c, index=index, text="".join(self.text_parts), token_ids=list(self.token_ids),
                                         logprobs=None if self.logprobs is None else list(self.logprobs))
        return dataclasses.replace(self.latest, outputs=[completion], prompt_logprobs=self.prompt_logprobs)


class ParentRequest:
    """A request for `params.n` samples of one prompt, run as n child engine requests.

    Child i has id `{request_id}-{i}` and `child_params(params, i)`; submit it with
    `output_kind` and feed every output it yields to `add(i, out)`.
    """

    output_kind = RequestOutputKind.DELTA

    def __init__(self, request_id: str, params: SamplingParams):
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self._children = [_ChildOutput() for _ in range(self.n)]
        self.prompt_logprobs: PromptLogprobs | None = None  # child 0 scores the prompt for all n

    def child_id(self, index: int) -> str:
        return f"{self.request_id}-{index}"

    def child_params(self, index: int) -> SamplingParams:
        return child_params(self.params, index)

    def children(self) -> list[tuple[str, SamplingParams]]:
        """(child id, child params) for child 0..n-1: what to submit to the engine."""
        return [(self.child_id(i), self.child_params(i)) for i in range(self.n)]

    def add(self, index: int, delta: RequestOutput) -> None:
        """Record one of child `index`'s outputs (a delta)."""
        self._children[index].add(delta)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    def child_output(self, index: int) -> RequestOutput | None:
        """Child `index` so far as one cumulative output (outputs[0].index = index); None before its first."""
        child = self._children[index]
        if child.latest is None:
            return None
        out = child.cumulative(index)
        return out if self.prompt_logprobs is None else dataclasses.replace(out, prompt_logprobs=self.prompt_logprobs)

    @property
    def finished(self) -> bool:
        return all(c.latest is not None and c.latest.finished for c in self._children)

    @property
    def num_output_tokens(self) -> int:
        """Tokens received across the children (what the request is billed)."""
        return sum(len(c.token_ids) for c in self._children)

    def output(self) -> RequestOutput:
        """The parent's RequestOutput: outputs[i] is child i. Raises ValueError before every child
        has produced an output."""
        maybe = [self.child_output(i) for i in range(self.n)]
        outs = [o for o in maybe if o is not None]
        if len(outs) < self.n:
            raise ValueError(f"request {self.request_id!r}: a child has produced no output yet")
        first = outs[0]
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids, [o.outputs[0] for o in outs],
                             all(o.finished for o in outs), first.num_cached_tokens, first.metrics,
                             self.prompt_logprobs, first.pooled)
