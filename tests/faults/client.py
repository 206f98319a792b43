"""Requests as a fault scenario sends them, each classified into one ledger outcome (ledger.py).

Everything is raw HTTP (httpx) rather than the openai SDK so that every byte the server sent is
seen: the SDK would retry, or turn a truncated stream into a clean end."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass

import httpx

MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Result:
    outcome: str
    detail: str = ""
    latency_ms: float = 0.0
    chunks: int = 0
    text: str = ""
    completion_tokens: int | None = None


def chat_body(content: str, max_tokens: int, *, stream: bool = True, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _refusal(status: int, raw: bytes, headers: httpx.Headers, latency_ms: float) -> Result:
    """A non-200 answer: explicit when it is the API's error body and not a 500."""
    try:
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["message"]
    except (ValueError, KeyError, TypeError, AssertionError):
        return Result("lost", f"{status} without an OpenAI error body: {raw[:200]!r}", latency_ms)
    if status >= 500 and status != 503:
        return Result("lost", f"{status}: {error['message'][:200]}", latency_ms)
    if status in (429, 503):
        if "retry-after" not in headers:
            return Result("lost", f"{status} without Retry-After", latency_ms)
        return Result("shed", error.get("code") or "", latency_ms)
    return Result("error", f"{status} {error.get('code')}", latency_ms)


async def send(http: httpx.AsyncClient, path: str, body: dict, headers: dict[str, str] | None = None, *,
               cancel_after: int | None = None, read_pause_s: float = 0.0,
               arrivals: list[float] | None = None) -> Result:
    """POST `body`; a stream is read event by event (pausing `read_pause_s` between them), and hung
    up after `cancel_after` events when given (0: right after the response head). `arrivals` gets the
    perf_counter time of every event that carried a token (inter-token latency)."""
    start = time.perf_counter()
    chunks, text, usage, finished, done = 0, [], None, False, False
    try:
        async with http.stream("POST", path, json=body, headers=headers or {}) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                return _refusal(resp.status_code, raw, resp.headers, (time.perf_counter() - start) * 1000)
            if not body.get("stream"):
                raw = await resp.aread()
                try:
                    data = json.loads(raw)
                    choice = data["choices"][0]
                    assert choice["finish_reason"] is not None
                except (ValueError, KeyError, TypeError, IndexError, AssertionError):
                    return Result("lost", f"200 with a body that is not a completion: {raw[:200]!r}")
                content = choice.get("message", {}).get("content") or choice.get("text") or ""
                return Result("completed", "", (time.perf_counter() - start) * 1000, 1, content,
                              data["usage"]["completion_tokens"])
            if cancel_after == 0:
                return Result("cancelled")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    return Result("error", str(event["error"].get("message", ""))[:200], chunks=chunks)
                chunks += 1
                for choice in event.get("choices", []):
                    delta = choice.get("delta") or {}
                    text.append(delta.get("content") or choice.get("text") or "")
                    if arrivals is not None and (delta.get("content") or choice.get("text")):
                        arrivals.append(time.perf_counter())
                    finished = finished or choice.get("finish_reason") is not None
                usage = event.get("usage") or usage
                if cancel_after is not None and chunks >= cancel_after:
                    return Result("cancelled", chunks=chunks)
                if read_pause_s:
                    await asyncio.sleep(read_pause_s)
    except httpx.ConnectError as e:
        return Result("refused", repr(e))
    except httpx.HTTPError as e:  # reset, truncated body, timeout: the answer never ended properly
        return Result("lost", f"{type(e).__name__} after {chunks} chunks: {e}", chunks=chunks)
    latency = (time.perf_counter() - start) * 1000
    if not (done and finished):
        return Result("lost", f"stream ended without {'a finish_reason' if done else '[DONE]'} after {chunks}",
                      latency, chunks)
    return Result("completed", "", latency, chunks, "".join(text), usage and usage.get("completion_tokens"))


def stalled_reader(host: str, port: int, body: dict, headers: dict[str, str] | None = None,
                   recv_buffer: int = 4096, path: str = "/v1/chat/completions") -> socket.socket:
    """Send a streaming request on a socket with a tiny receive buffer and never read it: the
    server sees backpressure almost at once. The caller closes the socket."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, recv_buffer)
    sock.connect((host, port))
    payload = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}", *(f"{k}: {v}" for k, v in (headers or {}).items()), "", ""]
    sock.sendall("\r\n".join(head).encode() + payload)
    return sock
