"""--reasoning-parser deepseek_r1 on a real server: the model's `<think>...</think>` (forced here with a
regex constraint: SmolLM2 does not think by itself) comes back split from the answer on every API:
chat's message.reasoning and reasoning_content, streamed deltas that reassemble to the whole message,
usage's reasoning_tokens, a Responses `reasoning` item (streamed too) and a Messages `thinking` block
(through the anthropic SDK's accumulator); an assistant turn sending reasoning_content back is taken."""

from __future__ import annotations

import anthropic
import pytest

from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess

pytestmark = requires_smollm2
MODEL = "smollm2-135m"
THINK = r"<think>[a-z]{3,10}( [a-z]{3,10}){1,3}</think>[A-Z][a-z]{2,10}"
ASK = [{"role": "user", "content": "What is the capital of France? Think first."}]
FORCED = {"structured_outputs": {"regex": THINK}, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    # the regex forces the thinking too: SmolLM2 does not close a thinking by itself (by default a
    # constraint starts after </think>, tests/e2e/test_reasoning_constraint.py)
    s = ServerProcess("--dtype", "float32", "--reasoning-parser", "deepseek_r1", "--structured-outputs-config",
                      '{"enable_in_reasoning": true}')
    s.wait_ready()
    yield s
    assert s.stop() == 0, s.log_tail()


def test_chat_splits_thinking_and_streams_it_as_deltas(server) -> None:
    client = server.client()
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, extra_body=FORCED)
    message = whole.choices[0].message.model_dump()
    assert message["reasoning"] and message["reasoning"] == message["reasoning_content"]
    assert "<think>" not in message["reasoning"] and message["content"][0].isupper()
    assert " " in message["reasoning"] and "</think>" not in (message["content"] or "")
    assert whole.usage.completion_tokens_details.reasoning_tokens > 2
    assert whole.usage.completion_tokens_details.reasoning_tokens < whole.usage.completion_tokens
    reasoning = content = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, extra_body=FORCED,
                                                stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta.model_dump()
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            assert delta.get("reasoning") == delta.get("reasoning_content")
    assert (reasoning, content) == (message["reasoning"], message["content"])
    # the thinking sent back with the assistant turn (either name) is accepted, the turn answered
    again = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        *ASK, {"role": "assistant", "content": message["content"], "reasoning_content": message["reasoning"]},
        {"role": "user", "content": "And of Italy?"}])
    answered = again.choices[0].message
    assert answered.content or answered.model_dump()["reasoning"]  # unforced and unclosed: all thinking (R1)
    assert again.usage.prompt_tokens > whole.usage.prompt_tokens + 5


def test_responses_reasoning_item_and_its_stream(server) -> None:
    client = server.client()
    whole = client.responses.create(model=MODEL, input=ASK[0]["content"], max_output_tokens=40, extra_body=FORCED)
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "message"]
    thought = whole.output[0].content[0].text
    assert thought and "<think>" not in thought and whole.output_text[0].isupper()
    assert whole.usage.output_tokens_details.reasoning_tokens > 2
    events = list(client.responses.create(model=MODEL, input=ASK[0]["content"], max_output_tokens=40,
                                          extra_body=FORCED, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == thought and events[-1].response.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_messages_thinking_block_through_the_sdk(server) -> None:
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    whole = claude.messages.create(model=MODEL, max_tokens=40, messages=ASK, extra_body=FORCED)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking and whole.content[1].text[0].isupper()
    with claude.messages.stream(model=MODEL, max_tokens=40, messages=ASK, extra_body=FORCED) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
        [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in whole.content]
