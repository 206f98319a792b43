"""Disaggregated prefill/decode (the `disaggregated` policy): before a request goes to its decode
replica, one of the group's prefill replicas (--kv-role prefill) runs the prompt, and the prompt's
KV blocks move from it to that decode replica (--kv-role decode) by block hash: only the blocks the
decode replica lacks are written. The client's stream then comes from the decode replica as usual,
its prompt a prefix-cache hit. Any failure on the way leaves the decode replica to compute the
prompt itself: the request never fails because of the transfer."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

import httpx

log = logging.getLogger("ferrylm.router")


class PrefillTransfer:
    """Round-robin over each group's prefill replicas; `run` does one prompt's prefill and transfer."""

    def __init__(self, client: httpx.AsyncClient, timeout_s: float, connect_timeout_s: float,
                 transfer_key: str | None):
        self.client = client
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._transfer_auth = {"authorization": f"Bearer {transfer_key}"} if transfer_key else {}
        self._next: dict[str, Iterator[str]] = {}

    def _prefill_url(self, group: str, urls: tuple[str, ...]) -> str:
        if group not in self._next:
            self._next[group] = itertools.cycle(urls)
        return next(self._next[group])

    async def run(self, group: str, urls: tuple[str, ...], model: str, decode_url: str, token_ids: tuple[int, ...],
                  headers: dict[str, str], cache_salt: str | None = None) -> int | None:
        """Blocks written into the decode replica, or None when anything failed (logged). The prefill
        runs under the request's cache salt, so its blocks carry the hashes the decode replica's
        request will look up; the KV routes get the transfer credential, never the tenant's."""
        prefill = self._prefill_url(group, urls)
        auth = {k: v for k, v in headers.items() if k.lower() in ("authorization", "x-request-id")}
        transfer = {k: v for k, v in auth.items() if k.lower() == "x-request-id"} | self._transfer_auth
        salt = {"cache_salt": cache_salt} if cache_salt else {}
        try:
            ran = await self.client.post(prefill + "/v1/completions", headers=auth, timeout=self.timeout,
                                         json={"model": model, "prompt": list(token_ids), "max_tokens": 1,
                                               "temperature": 0} | salt)
            ran.raise_for_status()
            kv = await self.client.post(prefill + "/v1/kv/export", headers=transfer, timeout=self.timeout,
                                        json={"prompt_token_ids": list(token_ids)} | salt)
            kv.raise_for_status()
            moved = await self.client.post(decode_url + "/v1/kv/import", content=kv.content, timeout=self.timeout,
                                           headers=transfer | {"content-type": "application/octet-stream"})
            moved.raise_for_status()
            return int(moved.json()["imported_blocks"])
        except (httpx.HTTPError, ValueError, KeyError) as e:
            log.warning("disaggregated prefill failed; the decode replica computes the prompt",
                        extra={"prefill": prefill, "decode": decode_url, "reason": f"{type(e).__name__}: {e}"})
            return None
