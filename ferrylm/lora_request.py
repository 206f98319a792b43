"""LoRARequest: which adapter a request of the offline API runs through (vLLM's spelling)."""

from __future__ import annotations

from typing import NamedTuple


class LoRARequest(NamedTuple):
    """`lora_name` names the adapter (loaded from `lora_path`, a peft directory, the first time it is
    used); `lora_int_id` is vLLM's numeric id, accepted and not needed here."""

    lora_name: str
    lora_int_id: int
    lora_path: str
