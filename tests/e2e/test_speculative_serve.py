"""`ferrylm serve --speculative-config` end to end: greedy chat through the official client equals
plain decoding, streamed and not, the spec_decode counters move on /metrics, and a bad config is a
clear error at start-up (before any weights load)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ferrylm import SamplingParams
from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess

pytestmark = requires_smollm2
MODEL = "smollm2-135m"
TEXT = ("The harbour was quiet that morning. \"We sail at noon,\" said the captain, \"whatever the wind does.\" "
        "The crew loaded barrels of water, coils of rope and a crate of oranges.")
MESSAGES = [{"role": "user", "content": f"Repeat the following passage word for word:\n{TEXT}"}]


@pytest.fixture(scope="module")
def spec_server():
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    server = ServerProcess("--dtype", "float32", "--speculative-config", config)
    server.wait_ready()
    yield server
    assert server.stop() == 0


def test_greedy_chat_equals_plain_decoding_and_counts_drafts(spec_server, llm_fp32):
    client = spec_server.client()
    generated0 = spec_server.wait_idle()["ferrylm:generation_tokens_total"]  # the readiness probe's too
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=60)
    expected = llm_fp32.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0]
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert reply.usage.completion_tokens == len(expected.outputs[0].token_ids)
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=60,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    m = spec_server.wait_idle()
    drafts = m["ferrylm:spec_decode_num_drafts_total"]
    drafted = m["ferrylm:spec_decode_num_draft_tokens_total"]
    accepted = m["ferrylm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= drafted
    assert m["ferrylm:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0
    per_pos = sum(v for k, v in m.items() if k.startswith("ferrylm:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == accepted
    assert m["ferrylm:generation_tokens_total"] - generated0 == 2 * reply.usage.completion_tokens  # each once


@pytest.mark.parametrize("config, message", [
    ('{"method": "eagle9", "num_speculative_tokens": 2}', "unknown"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown keys"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "not implemented"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs 'model'"),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent/draft"}', "no such model"),
    ('{"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 30}', "must be below the target's 30"),
    ("not json", "not valid JSON"),
])
def test_bad_speculative_config_is_a_start_up_error(config, message):
    done = subprocess.run([sys.executable, "-m", "ferrylm.cli", "serve", "--speculative-config", config],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_a_draft_model_with_another_vocabulary_is_a_start_up_error(tmp_path):
    from tests.gpu.random_model import model_config
    from tests.model.draft_models import write_random

    path = write_random(model_config("tiny"), tmp_path / "tiny-draft")
    config = json.dumps({"method": "draft_model", "num_speculative_tokens": 2, "model": str(path)})
    done = subprocess.run([sys.executable, "-m", "ferrylm.cli", "serve", "--speculative-config", config],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "vocabulary of 320 tokens, the target 49152" in done.stderr
