"""reserved_tokens: what a request reserves against its tenant's limits, the same for `ferrylm
serve` and `ferrylm gateway` — without max_tokens, the rest of the context window per choice."""

from __future__ import annotations

import asyncio

import pytest

from ferrylm.gateway.reservation import ReservedTokens, reserved_tokens


def test_max_tokens_per_choice_per_prompt():
    assert reserved_tokens([10], 1, 50, 2048) == ReservedTokens(10, 50)
    assert reserved_tokens([10, 30], 3, 50, 2048) == ReservedTokens(120, 300)
    assert reserved_tokens([10], 1, 50, None) == (10, 50), "max_tokens needs no context window"


def test_without_max_tokens_the_rest_of_the_context_window():
    assert reserved_tokens([100], 1, None, 2048) == (100, 1948)
    assert reserved_tokens([100, 1000], 2, None, 2048) == (2200, 2 * (1948 + 1048))
    assert reserved_tokens([4096], 1, None, 2048) == (4096, 1), "over the window: at least 1, as the engine"


def test_unknown_window_uses_the_fallback_or_refuses():
    assert reserved_tokens([100], 2, None, None, fallback_max_tokens=256) == (200, 512)
    with pytest.raises(ValueError):
        reserved_tokens([100], 1, None, None)
    with pytest.raises(ValueError):
        reserved_tokens([100], 0, 5, 2048)


def test_the_standalone_gateway_reserves_the_replicas_window():
    """The router path: the context window comes from the replicas' /load (the largest of them),
    the router default only until one has reported."""
    from ferrylm.http.protocol import ChatCompletionRequest, CompletionRequest
    from ferrylm.router.app import GatewayState, _route_context
    from ferrylm.router.config import GatewayServerConfig, GroupConfig, RouterConfig

    state = GatewayState(GatewayServerConfig(RouterConfig((GroupConfig("m", ("http://a", "http://b")),))))
    group = state.registry.resolve("m")
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x" * 40}], n=2)

    def reserve(req) -> tuple[int, int]:
        ctx = asyncio.run(_route_context(state, group, req))
        return ctx.prompt_tokens, ctx.expected_output

    prompt = reserve(chat)[0] // 2
    assert reserve(chat) == (2 * prompt, 2 * 256), "no replica has reported: the router default"
    group.replicas[0].max_model_len, group.replicas[1].max_model_len = 1024, 2048
    assert reserve(chat) == (2 * prompt, 2 * (2048 - prompt))
    assert reserve(chat.model_copy(update={"max_tokens": 7})) == (2 * prompt, 14)
    assert reserve(chat.model_copy(update={"max_completion_tokens": 9})) == (2 * prompt, 18)
    completion = CompletionRequest(model="m", prompt=["abcd" * 10, "abcd" * 20], max_tokens=None)
    lens = [11, 21]  # the text estimate: 4 characters a token, plus one
    assert reserve(completion) == (sum(lens), sum(2048 - n for n in lens))
    assert reserve(CompletionRequest(model="m", prompt="hi"))[1] == 16, "completions default to 16"
