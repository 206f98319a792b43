"""RedisBucketStorage: token buckets shared by every gateway replica through one Redis.

Each take/give is one Lua script, which Redis runs atomically, so concurrent gateways cannot both
spend the same tokens. Time comes from Redis' own clock (one clock for all replicas) unless a
clock is injected (tests). Each bucket is a hash {level, ts, cap} that expires once it would be
full again, so idle tenants cost no memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import redis

from ferrylm.gateway.rate_limit import BucketSpec, TakeResult

_NOW_AND_REFILL = """
local function fmt(x) return string.format('%.17g', x) end
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function refilled(i)
  local cap, rate = tonumber(ARGV[3*i - 1]), tonumber(ARGV[3*i])
  local state = redis.call('HMGET', KEYS[i], 'level', 'ts')
  local level = tonumber(state[1])
  if level == nil then return cap end
  return math.min(cap, level + math.max(0, now - tonumber(state[2])) * rate)
end
local function store(i, level)
  local cap, rate = tonumber(ARGV[3*i - 1]), tonumber(ARGV[3*i])
  redis.call('HSET', KEYS[i], 'level', fmt(level), 'ts', fmt(now), 'cap', fmt(cap))
  redis.call('PEXPIRE', KEYS[i], math.ceil((cap - level) / rate * 1000) + 1000)
end
"""

# ARGV: now ('' = Redis TIME), then capacity, rate/s, amount per bucket. Returns ok, then
# level and wait per bucket, as full-precision strings (Lua numbers would come back truncated to integers).
_TAKE = _NOW_AND_REFILL + """
local levels, waits, ok = {}, {}, true
for i = 1, #KEYS do
  local amount = tonumber(ARGV[3*i + 1])
  levels[i] = refilled(i)
  if levels[i] + 1e-3 >= amount then waits[i] = 0
  else waits[i] = (amount - levels[i]) / tonumber(ARGV[3*i]); ok = false end
end
if ok then
  for i = 1, #KEYS do
    levels[i] = levels[i] - tonumber(ARGV[3*i + 1])
    store(i, levels[i])
  end
end
local out = {ok and 1 or 0}
for i = 1, #KEYS do out[#out + 1] = fmt(levels[i]); out[#out + 1] = fmt(waits[i]) end
return out
"""

_GIVE = _NOW_AND_REFILL + """
local out = {}
for i = 1, #KEYS do
  local level = math.min(tonumber(ARGV[3*i - 1]), refilled(i) + tonumber(ARGV[3*i + 1]))
  store(i, level)
  out[i] = fmt(level)
end
return out
"""


class RedisBucketStorage:
    """Buckets in Redis under `prefix`; atomic across processes and hosts."""

    def __init__(self, client: redis.Redis, prefix: str = "ferrylm:rl:",
                 clock: Callable[[], float] | None = None):
        self._client = client
        self._prefix = prefix
        self._clock = clock
        self._take = client.register_script(_TAKE)
        self._give = client.register_script(_GIVE)

    @classmethod
    def from_url(cls, url: str, prefix: str = "ferrylm:rl:",
                 clock: Callable[[], float] | None = None) -> "RedisBucketStorage":
        client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        return cls(client, prefix, clock)

    def _args(self, specs: Sequence[BucketSpec], amounts: Sequence[float]) -> tuple[list[str], list]:
        keys = [self._prefix + s.key for s in specs]
        args: list = [repr(self._clock()) if self._clock else ""]
        for s, amount in zip(specs, amounts):
            args += [repr(float(s.capacity)), repr(float(s.rate)), repr(float(amount))]
        return keys, args

    def take(self, specs: Sequence[BucketSpec], amounts: Sequence[float]) -> TakeResult:
        keys, args = self._args(specs, amounts)
        out = self._take(keys=keys, args=args)
        levels = tuple(float(v) for v in out[1::2])
        waits = tuple(float(v) for v in out[2::2])
        return TakeResult(bool(int(out[0])), levels, waits)

    def give(self, specs: Sequence[BucketSpec], amounts: Sequence[float]) -> tuple[float, ...]:
        keys, args = self._args(specs, amounts)
        return tuple(float(v) for v in self._give(keys=keys, args=args))

    def check_invariants(self) -> None:
        """Every bucket under the prefix is finite and within its capacity (scans: tests only)."""
        for key in self._client.scan_iter(match=self._prefix + "*", count=500):
            values = self._client.hmget(key, "level", "ts", "cap")
            if None in values:  # expired between the scan and the read
                continue
            level, ts, cap = (float(v) for v in values if v is not None)
            if not (math.isfinite(level) and math.isfinite(ts)) or level > cap + 1e-6:
                raise AssertionError(f"bucket {key!r}: level {level} cap {cap} ts {ts}")

    def close(self) -> None:
        self._client.close()
