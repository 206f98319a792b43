"""FerryLM: a self-hosted LLM serving stack."""

from ferrylm.lora_request import LoRARequest
from ferrylm.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str):
    # Lazy so that `import ferrylm` (e.g. for SamplingParams) does not import torch.
    if name == "LLM":
        from ferrylm.engine.llm import LLM

        return LLM
    raise AttributeError(name)
