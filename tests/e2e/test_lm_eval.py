"""lm-evaluation-harness against `ferrylm serve`: a multiple_choice task (tests/data/lm_eval_tiny, no
download) through `--model local-completions` (echo + logprobs + max_tokens 0 on /v1/completions)
gives the per-item loglikelihoods of lm-eval's own `hf` backend on the same GGUF, within 1e-3
(float32 server). lm-eval is in the test extra (`make test` installs it); `make test-lm-eval` runs
this file alone."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ferrylm.model.model_source import resolve_model
from tests.conftest import requires_smollm2

pytestmark = [requires_smollm2, pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                                   reason="lm-eval not installed: pip install -e '.[test]'")]

DATA = Path(__file__).resolve().parents[1] / "data" / "lm_eval_tiny" / "choices.jsonl"
TASK = """task: ferry_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _run_lm_eval(tmp: Path, name: str, model: str, model_args: str) -> dict[int, list[float]]:
    """Per document, the loglikelihood of each choice, from lm-eval's logged samples."""
    out = tmp / name
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", "ferry_tiny_mc",
           "--include_path", str(tmp / "task"), "--log_samples", "--output_path", str(out), "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = [json.loads(line) for path in out.rglob("samples_*.jsonl") for line in path.read_text().splitlines()]
    assert samples, done.stderr[-3000:]
    return {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}


def test_loglikelihoods_equal_lm_evals_hf_backend(api_server, llm_fp32, tmp_path):
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "ferry_tiny_mc.yaml").write_text(TASK.format(data=DATA))
    tokenizer_dir = tmp_path / "tokenizer"
    llm_fp32.get_tokenizer().hf.save_pretrained(tokenizer_dir)
    served = _run_lm_eval(tmp_path, "served", "local-completions",
                          f"model=smollm2-135m,base_url={api_server.url('/v1/completions')},"
                          f"tokenizer_backend=huggingface,tokenizer={tokenizer_dir},tokenized_requests=True,"
                          "num_concurrent=1,max_retries=1")
    source = resolve_model("smollm2-135m")
    reference = _run_lm_eval(tmp_path, "hf", "hf", f"pretrained={source.directory},gguf_file={source.path.name},"
                                                   f"dtype=float32,tokenizer={tokenizer_dir}")
    assert served.keys() == reference.keys() and len(served) == len(DATA.read_text().splitlines())
    for doc, values in served.items():
        assert len(values) == len(reference[doc])
        assert max(abs(a - b) for a, b in zip(values, reference[doc])) < 1e-3, (doc, values, reference[doc])
