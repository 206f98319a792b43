"""The disk tier's files (--kv-offload-disk-path): the runner's side of engine/disk_tier.py.

One file per KV block, `<block hash>-<owner>.kv` in a directory named by the model's fingerprint
(`layout_fingerprint`: the weights' files, dtype, quantization and every KV part's shape), so a
restart of the same model finds its blocks and another model or layout never looks at them. Each
file carries a header (magic, fingerprint, hash, owner, payload size, CRC-32) checked on every read:
a truncated, corrupt or foreign file is reported lost and never copied into the cache.

Writes leave the step at once: the step gathers the evicted blocks' bytes from the device (one
index_select per KV part) and a writer thread writes them (temp file, then rename, so a crash never
leaves a half-written block under a real name). A read of a block still queued is served from the
queue. A failed write (a full disk), or one the queue has no room for (a disk slower than the evictions:
at most `max_queued_bytes` wait), is reported lost too. One server per directory (an flock); the
directory and files are the server user's only (0700 / 0600: they hold tenants' prompts' K/V)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import queue
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ferrylm.config import ConfigError

MAGIC = b"FERRYKV1"
HEADER = struct.Struct("<8s16s16s16sQI")  # magic, fingerprint, block hash, owner, payload bytes, crc32
SUFFIX = ".kv"
FLUSH_CHUNK = 32  # blocks gathered at a time by the shutdown's flush


def layout_fingerprint(model_path: str | os.PathLike[str] | None, facts: dict[str, Any],
                       parts: Sequence[torch.Tensor]) -> bytes:
    """16 bytes naming what a block's bytes depend on: the model's files (name, size, mtime: a changed
    or copied checkpoint is another model), `facts` (dtype, quantization, layout...) and each KV
    part's per-block shape and dtype."""
    files: list[tuple[str, int, int]] = []
    if model_path is not None:
        path = Path(model_path)
        entries = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        for p in entries:
            st = p.stat()
            files.append((str(p.resolve()), st.st_size, st.st_mtime_ns))
    shapes = [(list(p.shape[1:]), str(p.dtype)) for p in parts]
    blob = json.dumps({"files": files, "facts": facts, "parts": shapes}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).digest()[:16]


def _name(block_hash: int, owner: int) -> str:
    return f"{block_hash:032x}-{owner:032x}{SUFFIX}"


def _parse(name: str) -> tuple[int, int] | None:
    stem, _, suffix = name.rpartition(".")
    head, _, tail = stem.partition("-")
    if "." + suffix != SUFFIX or len(head) != 32 or len(tail) != 32:
        return None
    try:
        return int(head, 16), int(tail, 16)
    except ValueError:
        return None


class KVDiskStore:
    """Block files under `root`/<fingerprint hex>, for the KV parts `device_parts` (read from on
    writes) and `host_parts` (written on reads), as kv_swap.HostKVSwap holds them."""

    def __init__(self, root: str | os.PathLike[str], fingerprint: bytes, device_parts: Sequence[torch.Tensor],
                 host_parts: Sequence[torch.Tensor], max_queued_bytes: int = 512 << 20):
        self.fingerprint = fingerprint
        self.dir = Path(root) / fingerprint.hex()
        self.max_queued_bytes = max_queued_bytes
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._lock_file = open(self.dir / "LOCK", "a+b")  # noqa: SIM115 (held for the store's life)
        except OSError as e:
            raise ConfigError(f"--kv-offload-disk-path {root}: cannot use it ({e})") from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise ConfigError(f"--kv-offload-disk-path {root}: another running server uses it for this model; "
                              "give each server its own path") from None
        self.device_parts, self.host_parts = list(device_parts), list(host_parts)
        self.row_bytes = [p[0].numel() * p.element_size() for p in self.device_parts]
        self.block_bytes = sum(self.row_bytes)
        self._pending: dict[int, bytes] = {}  # hash → payload, queued for writing (reads are served from here)
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._lost: list[int] = []  # writes that failed since the last take_lost
        self._queue: queue.SimpleQueue[tuple[str, int, int, bytes] | None] = queue.SimpleQueue()
        self.read_seconds = 0.0
        self.blocks_read = self.bytes_written = self.bytes_read = 0
        for stale in self.dir.glob("*.tmp"):  # a write a crash interrupted
            stale.unlink(missing_ok=True)
        self._writer = threading.Thread(target=self._write_loop, name="ferrylm-kv-disk", daemon=True)
        self._writer.start()

    def entries(self) -> list[tuple[int, int]]:
        """(block hash, owner) of every block file here, least recently written first."""
        found = []
        for entry in os.scandir(self.dir):
            parsed = _parse(entry.name)
            if parsed is not None and entry.is_file():
                found.append((entry.stat().st_mtime_ns, *parsed))
        return [(h, o) for _, h, o in sorted(found)]

    # -- the step's orders ---------------------------------------------------------------
    def delete(self, orders: Sequence[tuple[int, int]]) -> None:
        """Queue the removal of each (hash, owner)'s file behind the writes already queued."""
        for block_hash, owner in orders:
            self._queue.put(("delete", block_hash, owner, b""))

    def write(self, orders: Sequence[tuple[int, int, int]], wait: bool = False) -> None:
        """Gather (device block, hash, owner) blocks' bytes now (before the step reuses them) and queue
        their files. `wait` (the shutdown's flush): a chunk at a time, each waiting for room in the
        queue instead of dropping what does not fit."""
        if wait:
            for start in range(0, len(orders), FLUSH_CHUNK):
                chunk = orders[start:start + FLUSH_CHUNK]
                while self._writer.is_alive() and not self._has_room(len(chunk) * self.block_bytes):
                    time.sleep(0.005)
                self._write(chunk, drop=False)
            return
        self._write(orders)

    def _has_room(self, size: int) -> bool:
        with self._lock:
            return self._queued_bytes == 0 or self._queued_bytes + size <= self.max_queued_bytes

    def _write(self, orders: Sequence[tuple[int, int, int]], drop: bool = True) -> None:
        if not orders:
            return
        idx = torch.tensor([b for b, _, _ in orders], dtype=torch.int64)
        rows = [p.index_select(0, idx.to(p.device)).cpu().contiguous().view(len(orders), -1).numpy()
                for p in self.device_parts]
        for i, (_, block_hash, owner) in enumerate(orders):
            payload = b"".join(r[i].tobytes() for r in rows)
            with self._lock:
                if drop and self._queued_bytes + len(payload) > self.max_queued_bytes:
                    self._lost.append(block_hash)  # the disk lags: this block is not kept
                    continue
                self._queued_bytes += len(payload)
                self._pending[block_hash] = payload
            self._queue.put(("write", block_hash, owner, payload))

    def read(self, orders: Sequence[tuple[int, int, int]]) -> list[int]:
        """Copy each (hash, owner, host block)'s file into the host block; the hashes whose file is
        missing, truncated, corrupt or another model's (those host blocks are left as they were)."""
        lost = []
        started = time.perf_counter()
        for block_hash, owner, host in orders:
            with self._lock:
                queued = self._pending.get(block_hash)
            payload = queued if queued is not None else self._load(block_hash, owner)
            if payload is None:
                lost.append(block_hash)
                continue
            offset = 0
            for part, size in zip(self.host_parts, self.row_bytes):
                row = torch.frombuffer(bytearray(payload[offset:offset + size]), dtype=part.dtype)
                part[host].copy_(row.view(part.shape[1:]))
                offset += size
            self.blocks_read += 1
            self.bytes_read += len(payload)
        self.read_seconds += time.perf_counter() - started
        return lost

    def take_lost(self) -> list[int]:
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued writes (up to `timeout`), then release the directory."""
        self._queue.put(None)
        self._writer.join(timeout)
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        finally:
            self._lock_file.close()

    # -- files -----------------------------------------------------------------------------
    def _path(self, block_hash: int, owner: int) -> Path:
        return self.dir / _name(block_hash, owner)

    def _load(self, block_hash: int, owner: int) -> bytes | None:
        """The checked payload of `block_hash`'s file, or None."""
        try:
            data = self._path(block_hash, owner).read_bytes()
        except OSError:
            return None
        if len(data) != HEADER.size + self.block_bytes:
            return None
        magic, fingerprint, hash_bytes, owner_bytes, size, crc = HEADER.unpack_from(data)
        payload = data[HEADER.size:]
        if (magic != MAGIC or fingerprint != self.fingerprint or size != self.block_bytes
                or hash_bytes != block_hash.to_bytes(16, "little") or owner_bytes != owner.to_bytes(16, "little")
                or zlib.crc32(payload) != crc):
            return None
        return payload

    def _write_loop(self) -> None:
        while (job := self._queue.get()) is not None:
            action, block_hash, owner, payload = job
            if action == "delete":
                try:
                    self._path(block_hash, owner).unlink(missing_ok=True)
                except OSError:
                    pass  # a file that cannot be removed is still checked on read; the writer goes on
                continue
            ok = self._write_file(block_hash, owner, payload)
            with self._lock:
                self._queued_bytes -= len(payload)
                if self._pending.get(block_hash) is payload:
                    del self._pending[block_hash]
                if not ok:
                    self._lost.append(block_hash)

    def _write_file(self, block_hash: int, owner: int, payload: bytes) -> bool:
        header = HEADER.pack(MAGIC, self.fingerprint, block_hash.to_bytes(16, "little"), owner.to_bytes(16, "little"),
                             len(payload), zlib.crc32(payload))
        final = self._path(block_hash, owner)
        tmp = final.with_name(final.name + ".tmp")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, final)
        except OSError:
            tmp.unlink(missing_ok=True)
            return False
        self.bytes_written += len(payload)
        return True
