"""Lua scripts that change Redis once per call, though redis-py may send a call twice.

The services' connections retry a command whose connection dropped (jobs/redis_server.py
`connect`), so a script the server ran before the drop runs again: a join would push its job
twice, a claim would answer "not claimed" for the group it had just claimed. A once-script takes
a key name as its last ARGV (`once_arg`, fresh per call); its first run keeps its answer there
for ONCE_TTL_S, and a repeat returns that answer and changes nothing. The key is in ARGV, not
KEYS, so that the scripts' KEYS keep their layout."""

import uuid

from jobs import keys

ONCE_TTL_S = 600  # far past any retry of a call (seconds)


def once(script: str) -> str:
    """`script` (a Lua body, answering with `return`) run at most once per `once_arg`."""
    return f"""
local once = ARGV[#ARGV]
local seen = redis.call('GET', once)
if seen then return cjson.decode(seen)[1] end
local function body()
{script}
end
local answer = body()
redis.call('SET', once, cjson.encode({{answer}}), 'EX', {ONCE_TTL_S})
return answer
"""


def once_arg() -> str:
    """The key a once-script's call keeps its answer under (the call's last ARGV)."""
    return keys.script_call(uuid.uuid4().hex)
