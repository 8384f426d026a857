"""Memory reserved per node, atomically, under leases (one Lua script: any number of dispatchers
can admit at once and a node is never promised more than its budget). Node agents renew a group's
lease while its rank runs there and release it when the rank exits; a lease nobody renews expires
and frees the bytes."""

import time
from typing import cast

import redis

from admission.placement import gib
from jobs import keys
from jobs.memory_waits import wake_admissions

# KEYS: reserved hash, leases zset for each node. ARGV: now, expiry, group, then need and
# capacity per node. Purges expired leases, then reserves on every node or on none. A group that
# holds bytes already is resized (a warm group taking a larger job).
_RESERVE = """
local now, expiry, group = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local nodes = #KEYS / 2
local function purge(reserved, leases)
  for _, old in ipairs(redis.call('ZRANGEBYSCORE', leases, '-inf', now)) do
    redis.call('HDEL', reserved, old)
    redis.call('ZREM', leases, old)
  end
end
local function total(reserved)
  local sum = 0
  for _, bytes in ipairs(redis.call('HVALS', reserved)) do sum = sum + tonumber(bytes) end
  return sum
end
for i = 1, nodes do
  local reserved, leases = KEYS[2 * i - 1], KEYS[2 * i]
  purge(reserved, leases)
  local need, capacity = tonumber(ARGV[2 + 2 * i]), tonumber(ARGV[3 + 2 * i])
  local used = total(reserved) - tonumber(redis.call('HGET', reserved, group) or 0)
  if used + need > capacity then return {0, i, used} end
end
for i = 1, nodes do
  redis.call('HSET', KEYS[2 * i - 1], group, ARGV[2 + 2 * i])
  redis.call('ZADD', KEYS[2 * i], expiry, group)
end
return {1, 0, 0}
"""


class Reservations:
    def __init__(self, conn: redis.Redis, lease_s: float):
        self.conn = conn
        self.lease_s = lease_s
        self._reserve = conn.register_script(_RESERVE)

    def reserve(self, group_id: str, needs: dict[str, tuple[int, int]]) -> str | None:
        """Reserve needs[node] = (bytes, capacity) on every node, or nothing. None on success,
        else why not ("node-1 has 1.2 GiB of 4.0 GiB reserved")."""
        names = list(needs)
        node_keys = [
            key for name in names for key in (keys.node_reserved(name), keys.node_leases(name))
        ]
        now = time.time()
        args: list[str | int | float] = [now, now + self.lease_s, group_id]
        for name in names:
            args.extend(needs[name])
        ok, index, used = self._reserve(keys=node_keys, args=args)
        if ok:
            return None
        name = names[int(index) - 1]
        need, capacity = needs[name]
        return (
            f"{name} has {gib(int(used))} of {gib(capacity)} reserved by running groups; "
            f"this job needs {gib(need)} there"
        )

    def reserved_bytes(self, name: str) -> int:
        """Bytes held on `name` by leases that have not expired."""
        return sum(self.held(name).values())

    def held(self, name: str) -> dict[str, int]:
        """Group id -> bytes held on `name`, for leases that have not expired."""
        live = cast(
            list[bytes], self.conn.zrangebyscore(keys.node_leases(name), time.time(), "+inf")
        )
        if not live:
            return {}
        values = cast(list[bytes | None], self.conn.hmget(keys.node_reserved(name), live))
        return {
            group.decode(): int(value)
            for group, value in zip(live, values, strict=True)
            if value is not None
        }

    def renew(self, group_id: str, name: str) -> None:
        self.conn.zadd(keys.node_leases(name), {group_id: time.time() + self.lease_s}, xx=True)

    def release(self, group_id: str, name: str) -> None:
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.hdel(keys.node_reserved(name), group_id)
            pipe.zrem(keys.node_leases(name), group_id)
            pipe.execute()
        wake_admissions(self.conn)
