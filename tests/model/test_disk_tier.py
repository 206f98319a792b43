"""The prefix cache's disk tier (--kv-offload-disk-path): blocks leaving the device pool are written
to files and read back through host blocks, within a run and after a restart of the same model;
greedy outputs are identical with the tier on and off; a corrupt, truncated or foreign file, or a
full disk, is a miss (counted as lost), never served."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ferrylm.config import ConfigError
from ferrylm.engine.disk_tier import DiskPrefixTier
from ferrylm.engine.llm import LLM
from ferrylm.model.kv_disk import HEADER, KVDiskStore
from ferrylm.sampling_params import SamplingParams
from tests.model.tiny_models import add_word_tokenizer, make_tiny_model

BLOCK = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CONTEXTS = [[1] + [10 + 17 * s + i for i in range(40)] for s in range(6)]


def test_disk_index_is_fair_and_orders_deletes_before_writes():
    disk = DiskPrefixTier(capacity=4, existing=[(1, 7), (2, 7)])  # a previous run's files, tenant 7
    for i in range(20):  # tenant 9 floods: it recycles its own files, tenant 7 keeps its two
        disk.store(100 + i, 1000 + i, owner=9)
    assert disk.holds(1) and disk.holds(2) and disk.num_used == 4
    writes, deletes = disk.take_orders()
    # files written and evicted within the step are never written; only the survivors are
    assert [h for _, h, _ in writes] == [1018, 1019] and deletes == ()
    disk.lose(1)  # a corrupt file: forgotten and deleted
    assert not disk.holds(1) and disk.take_orders() == ((), ((1, 7),)) and disk.blocks_lost == 1
    disk.check_invariants()


def test_store_round_trip_and_every_bad_file_is_a_miss(tmp_path):
    device = [torch.randn(6, 2, 3), torch.randint(0, 255, (6, 5), dtype=torch.uint8)]
    host = [torch.zeros(4, 2, 3), torch.zeros(4, 5, dtype=torch.uint8)]
    store = KVDiskStore(tmp_path, b"f" * 16, device, host)
    store.write([(b, 100 + b, 7) for b in range(5)])
    assert store.read([(102, 7, 0)]) == []  # served from the write queue or the file
    store.close()
    assert torch.equal(host[0][0], device[0][2]) and torch.equal(host[1][0], device[1][2])
    store = KVDiskStore(tmp_path, b"f" * 16, device, host)
    assert sorted(h for h, _ in store.entries()) == [100, 101, 102, 103, 104]
    files = {h: store.dir / f"{h:032x}-{7:032x}.kv" for h in range(100, 105)}
    data = files[101].read_bytes()
    files[101].write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one flipped bit
    files[102].write_bytes(data[:HEADER.size + 3])  # truncated
    files[103].write_bytes(files[100].read_bytes())  # another block's file under this name
    other = KVDiskStore(tmp_path, b"g" * 16, device, host)  # another model's directory
    other.write([(4, 104, 7)])
    other.close()
    files[104].write_bytes((other.dir / files[104].name).read_bytes())
    before = host[0][1].clone()
    assert store.read([(h, 7, 1) for h in range(101, 105)] + [(999, 7, 1)]) == [101, 102, 103, 104, 999]
    assert torch.equal(host[0][1], before)  # nothing bad was copied
    assert store.read([(100, 7, 1)]) == [] and torch.equal(host[0][1], device[0][0])
    store.close()


def test_one_server_per_directory(tmp_path):
    parts = [torch.zeros(2, 4)]
    store = KVDiskStore(tmp_path, b"f" * 16, parts, parts)
    with pytest.raises(ConfigError, match="another running server"):
        KVDiskStore(tmp_path, b"f" * 16, parts, parts)
    store.close()
    KVDiskStore(tmp_path, b"f" * 16, parts, parts).close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return add_word_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("disk") / "base"))


def _common(tiny_path: Path) -> dict:
    return dict(dtype="float32", block_size=BLOCK, num_gpu_blocks_override=16, max_num_seqs=2, enforce_eager=True)


def _host_gib(llm: LLM, blocks: int) -> float:
    """--kv-offload-cpu-gib holding `blocks` blocks of this model."""
    return blocks * llm.engine.executor.swap_bytes_per_block / (1 << 30)


def _first_turn(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": c} for c in CONTEXTS], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _second_turn(llm: LLM, first: list[list[int]]) -> list[list[int]]:
    prompts = [c + f + [200 + s, 201, 202, 203] for s, (c, f) in enumerate(zip(CONTEXTS, first))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def expected(tiny):
    llm = LLM(str(tiny), enable_prefix_caching=False, **_common(tiny))
    first = _first_turn(llm)
    host = _host_gib(llm, 12)
    return first, _second_turn(llm, first), host


def test_outputs_identical_and_hits_read_from_disk(tiny, expected, tmp_path):
    """A 16-block pool and a 12-block host tier for six 40-token contexts: the second turn's prefixes
    come back from disk (through the host tier), and the tokens do not change."""
    first, second, host = expected
    llm = LLM(str(tiny), kv_offload_cpu_gib=host, kv_offload_disk_path=str(tmp_path), **_common(tiny))
    assert _first_turn(llm) == first
    assert _second_turn(llm, first) == second
    stats = llm.engine.stats()
    assert stats.kv_offload_disk_hit_tokens >= 4 * 32 and stats.kv_offload_disk_blocks_read >= 16
    assert stats.kv_offload_disk_blocks_lost == 0 and stats.kv_offload_disk_bytes_written > 0
    assert stats.kv_offload_disk_read_seconds > 0
    llm.engine.scheduler.check_invariants()
    llm.engine.block_manager.tier.check_invariants()
    llm.engine.block_manager.disk.check_invariants()
    llm.shutdown()


def test_restart_serves_prefixes_from_disk_and_drops_bad_files(tiny, expected, tmp_path):
    """Turn 1 in one engine, turn 2 in a new one on the same directory (a restart): the prefixes
    are read from disk. Then the files are damaged, and a third engine recomputes instead."""
    first, second, host = expected
    before = LLM(str(tiny), kv_offload_cpu_gib=host, kv_offload_disk_path=str(tmp_path), **_common(tiny))
    assert _first_turn(before) == first
    before.shutdown()  # writes what the device pool still caches
    files = list(tmp_path.glob("*/*.kv"))
    assert len(files) >= 6 * 5
    after = LLM(str(tiny), kv_offload_cpu_gib=host, kv_offload_disk_path=str(tmp_path), **_common(tiny))
    assert _second_turn(after, first) == second
    stats = after.engine.stats()
    assert stats.kv_offload_disk_hit_tokens >= 6 * 32 and stats.kv_offload_disk_blocks_lost == 0
    assert stats.prefix_cache_hits >= 6 * 32
    after.shutdown()

    damaged = sorted(tmp_path.glob("*/*.kv"))
    for i, path in enumerate(damaged):
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2] if i % 2 else data[:-4] + bytes(4))  # truncated or corrupt
    third = LLM(str(tiny), kv_offload_cpu_gib=host, kv_offload_disk_path=str(tmp_path), **_common(tiny))
    assert _second_turn(third, first) == second
    stats = third.engine.stats()
    assert stats.kv_offload_disk_blocks_lost >= 6 and stats.kv_offload_disk_blocks_lost == \
        stats.kv_offload_disk_blocks_read
    third.engine.block_manager.tier.check_invariants()
    third.shutdown()


def test_another_model_never_reads_the_files(tiny, expected, tmp_path, tmp_path_factory):
    """A different model on the same path gets its own directory; files copied into it are misses."""
    first, _, host = expected
    writer = LLM(str(tiny), kv_offload_cpu_gib=host, kv_offload_disk_path=str(tmp_path), **_common(tiny))
    _first_turn(writer)
    writer.shutdown()
    other_model = add_word_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("other"), rms_norm_eps=1e-5))
    plain = LLM(str(other_model), enable_prefix_caching=False, **_common(other_model))
    other_first = _first_turn(plain)
    reference = _second_turn(plain, other_first)
    other = LLM(str(other_model), kv_offload_cpu_gib=host, kv_offload_disk_path=str(tmp_path),
                **_common(other_model))
    assert other.engine.block_manager.disk.num_used == 0
    other.shutdown()
    (mine,) = [d for d in tmp_path.iterdir() if d.is_dir() and any(d.glob("*.kv"))]
    (theirs,) = [d for d in tmp_path.iterdir() if d.is_dir() and d != mine]
    for path in mine.glob("*.kv"):  # the first model's blocks under the second model's directory
        (theirs / path.name).write_bytes(path.read_bytes())
    other = LLM(str(other_model), kv_offload_cpu_gib=host, kv_offload_disk_path=str(tmp_path),
                **_common(other_model))
    assert _first_turn(other) == other_first and _second_turn(other, other_first) == reference
    # the first turn's prompts have the same block hashes under both models: found, read, refused
    assert other.engine.stats().kv_offload_disk_blocks_lost >= 6 * 4
    other.shutdown()


FULL_DISK = textwrap.dedent("""
    import json, resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    from ferrylm.engine.llm import LLM
    from ferrylm.sampling_params import SamplingParams
    model, path, host, contexts = sys.argv[1], sys.argv[2], float(sys.argv[3]), json.loads(sys.argv[4])
    llm = LLM(model, dtype="float32", block_size=8, num_gpu_blocks_override=16, max_num_seqs=2, enforce_eager=True,
              kv_offload_cpu_gib=host, kv_offload_disk_path=path)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))  # the disk is full from here
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False)]
    prompts = [c + f + [200 + s, 201, 202, 203] for s, (c, f) in enumerate(zip(contexts, first))]
    second = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    stats = llm.engine.stats()
    llm.shutdown()
    print(json.dumps({"first": first, "second": second, "lost": stats.kv_offload_disk_blocks_lost,
                      "written": stats.kv_offload_disk_blocks_written}))
""")


def test_a_full_disk_is_a_miss(tiny, expected, tmp_path):
    """Every file write fails (RLIMIT_FSIZE below a block file, in a child process): the run's tokens
    are unchanged and the failed writes are counted lost, not served."""
    import json

    first, second, host = expected
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(tiny), str(tmp_path), str(host),
                           json.dumps(CONTEXTS)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["first"] == first and result["second"] == second
    assert result["written"] > 0 and result["lost"] > 0
    assert not list(tmp_path.glob("*/*.kv")) and not list(tmp_path.glob("*/*.tmp"))


def test_waiting_prefill_excludes_tier_hits(tiny, expected, tmp_path):
    """Admission's queued prefill (LoadReport.num_waiting_prompt_tokens) counts only what no tier
    holds: after turn 1, queued turn-2 prompts report their device, host and disk hits as cached."""
    first, _, host = expected
    llm = LLM(str(tiny), kv_offload_cpu_gib=host, kv_offload_disk_path=str(tmp_path), **_common(tiny))
    _first_turn(llm)
    prompts = [c + f + [200 + s, 201, 202, 203] for s, (c, f) in enumerate(zip(CONTEXTS, first))]
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"turn2-{i}", prompt, PARAMS)
    stats = llm.engine.stats()
    total = sum(len(p) for p in prompts)
    # every prompt's first 48 tokens (6 blocks) are in some tier: only the rest is prefill
    assert stats.num_waiting_cached_tokens == 6 * 48
    assert stats.num_waiting_prompt_tokens == total - 6 * 48
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.stats().num_waiting_cached_tokens == 0
    llm.shutdown()


def test_a_lagging_disk_drops_writes_instead_of_queueing_without_bound(tmp_path):
    device = [torch.randn(8, 64)]  # 256 bytes a block
    store = KVDiskStore(tmp_path, b"f" * 16, device, [torch.zeros(2, 64)], max_queued_bytes=256 * 3)
    with store._lock:  # noqa: SLF001  (as if two blocks still waited for a slow disk)
        store._queued_bytes = 256 * 2  # noqa: SLF001
    store.write([(b, 100 + b, 7) for b in range(3)])
    assert store.take_lost() == [101, 102]  # one more block fitted; the rest are reported lost
    store.close()
    assert oct(store.dir.stat().st_mode & 0o777) == "0o700"
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in store.dir.glob("*.kv"))


def test_a_block_being_read_up_is_not_offloaded_twice_and_own_hits_are_not_evicted():
    """Review findings: a key whose disk read is pending is not given a second host block when the
    device pool evicts its twin the same step; a request's disk reads never evict its own host hits."""
    from ferrylm.engine.prefix_tier import HostPrefixTier

    tier = HostPrefixTier(first_id=0, num_blocks=3)
    x, hit, other = (1, (1,)), (1, (2,)), (1, (3,))
    assert tier.reserve(x, owner=5) is not None
    assert tier.offload(40, x, owner=0) is None  # its K/V arrives by the read
    tier.confirm(x)
    tier.check_invariants()
    assert tier.offload(41, hit, owner=5) is not None and tier.offload(42, other, owner=5) is not None
    assert tier.reserve((1, (9,)), owner=5, protected={x, hit, other}) is None  # only own hits left: no room
    assert tier.reserve((1, (9,)), owner=5, protected={x, hit}) is not None and not tier.holds(other)
    assert tier.holds(x) and tier.holds(hit)
    tier.end_step()
    tier.check_invariants()


def test_the_shutdown_flush_waits_for_room_instead_of_dropping(tmp_path):
    device = [torch.randn(40, 64)]
    store = KVDiskStore(tmp_path, b"f" * 16, device, [torch.zeros(2, 64)], max_queued_bytes=256 * 2)
    store.write([(b, 100 + b, 7) for b in range(40)], wait=True)
    assert store.take_lost() == []
    store.close()
    assert len(list(store.dir.glob("*.kv"))) == 40


def test_no_flush_after_a_step_that_did_not_finish(tiny, expected, tmp_path):
    """A step whose execute raised left blocks registered whose K/V was never computed: shutdown
    writes nothing of the pool then (a restart would serve garbage)."""
    _, _, host = expected
    llm = LLM(str(tiny), kv_offload_cpu_gib=host, kv_offload_disk_path=str(tmp_path), **_common(tiny))
    llm.engine.add_request("r", CONTEXTS[0], PARAMS)

    def broken(step):
        raise RuntimeError("the device fell over mid-forward")

    llm.engine.executor.execute = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        llm.engine.step()
    del llm.engine.executor.execute  # the real one again, for the shutdown
    llm.shutdown()
    assert not list(tmp_path.glob("*/*.kv"))
