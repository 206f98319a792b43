"""top_k: unset, 0 or -1 turn it off (vLLM's convention); below -1 is a 400, not silently off."""

import pytest
from pydantic import ValidationError

from ferrylm.http.protocol import CompletionRequest


@pytest.mark.parametrize("top_k", [None, -1, 0, 1, 40])
def test_top_k_off_or_positive_is_accepted(top_k):
    assert CompletionRequest(model="m", prompt="x", top_k=top_k).top_k == top_k


@pytest.mark.parametrize("top_k", [-2, -5])
def test_top_k_below_minus_one_is_refused(top_k):
    with pytest.raises(ValidationError, match="top_k"):
        CompletionRequest(model="m", prompt="x", top_k=top_k)
