"""vLLM's runtime adapter routes: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
/v1/unload_lora_adapter {"lora_name"}, between engine steps, without a restart. An operator's API,
not a tenant's: only --lora-admin-key opens them (internal_auth.py); without it they are off (404).
Unloading an adapter whose requests still run answers 409 and changes nothing (they finish first)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse

from ferrylm.config import ConfigError
from ferrylm.engine.adapters import AdapterBusy
from ferrylm.executor import LoRAError
from ferrylm.http.body import read_json_body
from ferrylm.http.errors import APIError, invalid
from ferrylm.server.internal_auth import LORA_ADMIN, require_secret
from ferrylm.server.state import ServerState


async def _admin(request: Request) -> tuple[ServerState, dict]:
    state: ServerState = request.app.state.ferry
    await require_secret(request, state, LORA_ADMIN)
    if state.config.lora_admin_key is None:  # (require_secret let nothing through then)
        raise APIError(404, "Runtime LoRA loading is off: start the server with --enable-lora --lora-admin-key.")
    state.admit()
    body = await read_json_body(request, state.config.max_body_bytes)
    return state, body


def _name(body: dict) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise invalid("lora_name must be a non-empty string", "lora_name")
    return name


async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state, body = await _admin(request)
    name, path = _name(body), body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise invalid("lora_path must be a non-empty string (a peft adapter directory)", "lora_path")
    if name in state.config.served_model_names:
        raise invalid(f"{name!r} is the base model's served name", "lora_name")
    try:
        await state.admit().load_lora(name, path)
    except (LoRAError, ConfigError) as e:
        raise invalid(str(e), "lora_path") from None
    except AdapterBusy as e:
        raise APIError(409, str(e), "lora_name", "adapter_busy") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state, body = await _admin(request)
    name = _name(body)
    try:
        await state.admit().unload_lora(name)
    except KeyError:
        raise APIError(404, f"The LoRA adapter '{name}' is not loaded.", "lora_name", "model_not_found") from None
    except AdapterBusy as e:
        raise APIError(409, str(e), "lora_name", "adapter_busy") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
