"""lm-evaluation-harness against `ferrylm serve`: a multiple_choice task (tests/data/lm_eval_tiny, no
download) through `--model local-completions` (echo + logprobs + max_tokens 0 on /v1/completions)
gives the per-item loglikelihoods of lm-eval's own `hf` backend on the same GGUF, within 1e-3
(float32 server). lm-eval is in the test extra (`make test` installs it); `make test-lm-eval` runs
this file alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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


def _loglikelihoods(task_dir: Path, model, model_args: str | None = None) -> dict[int, list[float]]:
    """Per document, the loglikelihood of each choice, from lm-eval's logged samples (run in this
    process: each `python -m lm_eval` would pay its ~10 s import again)."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    results = evaluator.simple_evaluate(model=model, model_args=model_args, tasks=["ferry_tiny_mc"], log_samples=True,
                                        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                                        device="cpu", random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    samples = results["samples"]["ferry_tiny_mc"]
    assert samples
    return {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}


def test_loglikelihoods_equal_lm_evals_hf_backend(api_server, llm_fp32, hf_reference, tmp_path):
    """lm-eval's `hf` backend runs on the session's transformers model, which is transformers
    loading the same GGUF (conftest.hf_reference), handed to HFLM as a model instance."""
    from lm_eval.models.huggingface import HFLM

    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "ferry_tiny_mc.yaml").write_text(TASK.format(data=DATA))
    tokenizer_dir = tmp_path / "tokenizer"
    llm_fp32.get_tokenizer().hf.save_pretrained(tokenizer_dir)
    served = _loglikelihoods(tmp_path / "task", "local-completions",
                             f"model=smollm2-135m,base_url={api_server.url('/v1/completions')},"
                             f"tokenizer_backend=huggingface,tokenizer={tokenizer_dir},tokenized_requests=True,"
                             "num_concurrent=1,max_retries=1")
    reference = _loglikelihoods(tmp_path / "task", HFLM(pretrained=hf_reference, tokenizer=str(tokenizer_dir),
                                                        batch_size=1, device="cpu"))
    assert served.keys() == reference.keys() and len(served) == len(DATA.read_text().splitlines())
    for doc, values in served.items():
        assert len(values) == len(reference[doc])
        assert max(abs(a - b) for a, b in zip(values, reference[doc])) < 1e-3, (doc, values, reference[doc])
