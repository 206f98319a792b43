"""The request's output constraint: OpenAI's `response_format`, vLLM's `structured_outputs` and its
older `guided_*` fields, as one StructuredOutputsParams; and the compile check that turns a schema
the backend cannot compile or enforce into a 400 naming the field, before the engine sees it."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from ferrylm.engine.client import EngineClient
from ferrylm.http.disconnect import ClientDisconnected, cancel_on_disconnect
from ferrylm.http.errors import APIError, invalid
from ferrylm.http.protocol import SamplingRequest
from ferrylm.sampling_params import SamplingParamsError, StructuredOutputsParams

# vLLM's structured_outputs keys; the constraint ones map 1:1 onto StructuredOutputsParams
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_OPTIONS = ("disable_any_whitespace",)
_NEUTRAL_OPTIONS = {"disable_fallback": (False, True), "disable_additional_properties": (False,),
                    "whitespace_pattern": (None,), "structural_tag": (None,), "backend": (None, "auto", "xgrammar")}
# vLLM's guided_* (before structured_outputs) → the constraint each names
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_BACKENDS = (None, "auto", "xgrammar")


def _spec(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(param=param, **fields)
    except SamplingParamsError as e:
        raise invalid(f"Invalid '{param}': {str(e).rstrip('.')}.", param) from None


def _from_response_format(request: SamplingRequest) -> StructuredOutputsParams | None:
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _spec("response_format", json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise invalid("'response_format' of type 'json_schema' needs 'json_schema.schema'.",
                      "response_format.json_schema")
    return _spec("response_format", json=fmt.json_schema.schema_)


def _from_structured_outputs(raw: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if raw is None:
        return None
    fields: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _CONSTRAINTS or key in _OPTIONS:
            if value is not None:
                fields[key] = value
        elif key not in _NEUTRAL_OPTIONS or value not in _NEUTRAL_OPTIONS[key]:
            raise invalid(f"Unsupported parameter: 'structured_outputs.{key}'"
                          + (f" = {value!r}" if key in _NEUTRAL_OPTIONS else "") + " is not supported.",
                          f"structured_outputs.{key}")
    return _spec("structured_outputs", **fields)


def from_request(request: SamplingRequest) -> StructuredOutputsParams | None:
    """The one constraint the request asks for (None: free text); two at once is a 400."""
    extra = request.model_extra or {}
    if extra.get("guided_decoding_backend") not in _BACKENDS:
        raise invalid("Unsupported parameter: 'guided_decoding_backend' must be 'xgrammar' (or unset).",
                      "guided_decoding_backend")
    found = [spec for spec in (_from_response_format(request), _from_structured_outputs(request.structured_outputs))
             if spec is not None]
    found += [_spec(name, **{kind: extra[name]}) for name, kind in _GUIDED.items() if extra.get(name) is not None]
    if len(found) > 1:
        raise invalid(f"Only one output constraint may be given; got '{found[0].param}' and '{found[1].param}'.",
                      found[1].param)
    return found[0] if found else None


async def check_compiles(engine: EngineClient, spec: StructuredOutputsParams,
                         request: Request | None = None) -> None:
    """Compile now (in the compiler's worker processes, under its budget; cached), so a constraint the
    backend rejects, or that compiles for too long, is a 400 naming its field rather than a failed
    request later. A client that leaves meanwhile stops the compile if nobody else waits for it."""
    try:
        work = engine.prepare_structured_output(spec)
        await (cancel_on_disconnect(request, work) if request is not None else work)
    except APIError:
        raise
    except ClientDisconnected:
        raise APIError(499, "The client closed the request.", code="client_disconnected",
                       type_="invalid_request_error") from None
    except (ValueError, RuntimeError) as e:  # StructuredOutputError / RequestRejected carry the param
        raise invalid(str(e), getattr(e, "param", None) or spec.param) from None
