"""LoadReport: the one load snapshot. Its JSON round trip, the strictness that makes a renamed
field fail loudly at the router, a group combined as one engine, and the derived properties."""

from __future__ import annotations

import dataclasses

import pytest

from ferrylm.load_report import LoadReport


def report(**fields) -> LoadReport:
    return dataclasses.replace(LoadReport.empty(), **fields)


BUSY = report(num_waiting=3, num_running=5, num_waiting_prompt_tokens=400, kv_blocks_used=30, kv_blocks_total=120,
              prefix_cache_queries=900, prefix_cache_hits=320, num_preemptions=2, prompt_tokens_total=5000,
              generation_tokens_total=700, num_waiting_output_tokens=96, num_running_output_tokens=80,
              num_waiting_certain_output_tokens=16, num_running_certain_output_tokens=4, max_num_seqs=8,
              kv_offload_disk_read_seconds=0.25)


def test_json_round_trip_carries_every_field_and_the_usage():
    body = BUSY.to_json()
    assert set(body) == {f.name for f in dataclasses.fields(LoadReport)} | {"kv_cache_usage"}
    assert body["kv_cache_usage"] == 0.25 and body["max_num_seqs"] == 8 and body["healthy"] is True
    assert LoadReport.from_json(body) == BUSY
    unknown = report(healthy=False, max_num_seqs=None)
    assert LoadReport.from_json(unknown.to_json()) == unknown


def test_from_json_ignores_the_keys_that_are_not_load():
    body = BUSY.to_json() | {"block_size": 16, "max_model_len": 2048, "models": ["m"], "status": "ok"}
    assert LoadReport.from_json(body) == BUSY


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(LoadReport)])
def test_from_json_refuses_a_missing_field(field):
    body = BUSY.to_json()
    del body[field]
    with pytest.raises(ValueError, match=field):
        LoadReport.from_json(body)


def test_from_json_refuses_a_renamed_field():
    """The bug this type exists to stop: a renamed field used to read as a default 0 (idle)."""
    body = BUSY.to_json()
    body["waiting_output_tokens"] = body.pop("num_waiting_output_tokens")
    with pytest.raises(ValueError, match="num_waiting_output_tokens"):
        LoadReport.from_json(body)


@pytest.mark.parametrize("field, value", [("num_waiting", "3"), ("num_waiting", 3.0), ("num_running", True),
                                          ("num_running", None), ("healthy", 1), ("max_num_seqs", "8"),
                                          ("kv_offload_disk_read_seconds", "0.5"),
                                          ("kv_offload_disk_read_seconds", float("nan")),
                                          ("kv_offload_disk_read_seconds", False)])
def test_from_json_refuses_a_wrong_type(field, value):
    with pytest.raises(ValueError, match=field):
        LoadReport.from_json(BUSY.to_json() | {field: value})


@pytest.mark.parametrize("body", [[1, 2], "ok", None])
def test_from_json_refuses_what_is_not_an_object(body):
    with pytest.raises(ValueError):
        LoadReport.from_json(body)


def test_combine_is_the_fleet_as_one_engine():
    other = report(num_waiting=1, num_running=2, num_waiting_prompt_tokens=50, kv_blocks_used=70, kv_blocks_total=80,
                   prompt_tokens_total=10, generation_tokens_total=20, num_running_output_tokens=5, max_num_seqs=4,
                   healthy=False)
    fleet = LoadReport.combine([BUSY, other])
    assert (fleet.num_waiting, fleet.num_running, fleet.num_waiting_prompt_tokens) == (4, 7, 450)
    assert (fleet.kv_blocks_used, fleet.kv_blocks_total) == (100, 200)
    assert fleet.kv_cache_usage == 0.5, "the fleet's blocks, not the mean of 0.25 and 0.875"
    assert fleet.tokens_total == 5730 and fleet.num_running_output_tokens == 85 and fleet.prefix_cache_hits == 320
    assert fleet.max_num_seqs == 12 and fleet.healthy, "healthy while any replica is"
    assert LoadReport.combine([BUSY, BUSY]).kv_offload_disk_read_seconds == 0.5
    assert LoadReport.combine([BUSY, dataclasses.replace(other, max_num_seqs=None)]).max_num_seqs is None
    assert not LoadReport.combine([other]).healthy
    with pytest.raises(ValueError):
        LoadReport.combine([])


def test_derived_properties():
    assert BUSY.kv_cache_usage == 0.25 and BUSY.tokens_total == 5700 and BUSY.busy
    empty = LoadReport.empty()
    assert empty.kv_cache_usage == 0.0 and empty.tokens_total == 0 and not empty.busy and empty.healthy
    assert report(num_waiting=1).busy and report(num_running=1).busy
    assert not LoadReport.empty(healthy=False).healthy
    with pytest.raises(dataclasses.FrozenInstanceError):
        BUSY.num_waiting = 0  # type: ignore[misc]
