"""Once-scripts (jobs/once.py): a script call that redis-py sends twice, because the reply to
the first was lost with its connection, changes Redis once and answers the same both times.
The lost reply is real: a TCP proxy between the client and the real redis-server closes the
connection instead of passing on the reply to the next EVALSHA, and the services' own client
(jobs.redis_server.connect with ride_out_s) retries it."""

import contextlib
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
import redis

from jobs import keys
from jobs.once import once, once_arg
from jobs.redis_server import connect
from jobs.warm_groups import WarmGroups, next_key
from tests.jobs.test_warm_batch import busy, two_ranks

PUSH = "redis.call('RPUSH', KEYS[1], ARGV[1])\nreturn redis.call('LLEN', KEYS[1])"


class ReplyDropper:
    """Forwards one client's connections to Redis; when armed, the first reply after a request
    naming `armed` is dropped and both sockets closed (the server has run the command)."""

    def __init__(self, target: str):
        """`target`: the Redis's URL (the tests' is a unix socket)."""
        parsed = urlparse(target)
        self.family = socket.AF_UNIX if parsed.scheme == "unix" else socket.AF_INET
        self.address: str | tuple[str, int] = (
            parsed.path if parsed.scheme == "unix" else (parsed.hostname or "", parsed.port or 6379)
        )
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed: bytes | None = None
        self.dropped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.socket(self.family, socket.SOCK_STREAM)
            server.connect(self.address)
            pending = threading.Event()  # a request naming `armed` went to the server
            threading.Thread(target=self._up, args=(client, server, pending), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, pending), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, pending: threading.Event) -> None:
        while data := _recv(client):
            if self.armed is not None and self.armed in data:
                self.armed = None
                pending.set()
            server.sendall(data)
        _close(client, server)

    def _down(self, server: socket.socket, client: socket.socket, pending: threading.Event) -> None:
        while data := _recv(server):
            if pending.is_set():
                self.dropped += 1
                break
            client.sendall(data)
        _close(client, server)

    def close(self) -> None:
        self.listener.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


@pytest.fixture
def dropper(redis_url: str) -> Iterator[ReplyDropper]:
    found = ReplyDropper(redis_url)
    yield found
    found.close()


@pytest.fixture
def retrying(dropper: ReplyDropper, redis_url: str) -> Iterator[redis.Redis]:
    """The services' client (it retries a command whose connection dropped), via the proxy."""
    password = urlparse(redis_url).password
    auth = f":{password}@" if password else ""
    client = connect(f"redis://{auth}127.0.0.1:{dropper.port}/0", ride_out_s=5.0)
    yield client
    client.close()


def test_a_script_whose_reply_was_lost_runs_again_without_a_token(dropper, retrying, redis_conn):
    """What once-scripts are for: the plain script's retry pushes a second time."""
    script = retrying.register_script(PUSH)
    redis_conn.script_load(PUSH)  # loaded: the dropped reply is the EVALSHA's own
    dropper.armed = b"EVALSHA"
    assert script(keys=["t:plain"], args=["a"]) == 2  # the retry's answer
    assert dropper.dropped == 1
    assert redis_conn.lrange("t:plain", 0, -1) == [b"a", b"a"]


def test_a_once_script_whose_reply_was_lost_changes_redis_once(dropper, retrying, redis_conn):
    script = retrying.register_script(once(PUSH))
    redis_conn.script_load(once(PUSH))
    dropper.armed = b"EVALSHA"
    call = once_arg()
    assert script(keys=["t:once"], args=["a", call]) == 1  # the first run's answer
    assert dropper.dropped == 1
    assert redis_conn.lrange("t:once", 0, -1) == [b"a"]
    assert script(keys=["t:once"], args=["b", once_arg()]) == 2  # another call runs
    assert 0 < redis_conn.ttl(call) <= 600


def test_once_scripts_answer_tables_and_nothing_alike_on_a_repeat(redis_conn):
    table = redis_conn.register_script(once("return {1, 'two', 3}"))
    nothing = redis_conn.register_script(once("return false"))
    for script, answer in ((table, [1, b"two", 3]), (nothing, None)):
        call = once_arg()
        assert script(args=[call]) == answer
        assert script(args=[call]) == answer
    assert keys.script_call("x") == "ringq:once:x"


def test_a_join_whose_reply_was_lost_hands_the_job_over_once(dropper, retrying, redis_conn):
    """jobs/warm_groups.py `join`: without the token, the retry pushed the job id to every
    rank a second time (the group would start the same job twice in its batch)."""
    warm, group = WarmGroups(retrying), two_ranks("once-g1")
    busy(warm, group)
    redis_conn.script_load(warm._join.script)  # as registered: the EVALSHA runs it
    dropper.armed = b"EVALSHA"
    assert warm.join(group, "second", max_batch=4) == "joined"
    assert dropper.dropped == 1
    for rank in (0, 1):
        assert redis_conn.lrange(next_key(group.group_id, rank), 0, -1) == [b"second"]
    assert sorted(warm.batch(group.group_id)) == ["first", "second"]


def test_a_claim_whose_reply_was_lost_still_says_claimed(dropper, retrying, redis_conn):
    """`claim`: without the token, the retry found the group no longer idle and answered "not
    claimed", though the job's id was already on its ranks' lists."""
    warm, group = WarmGroups(retrying), two_ranks("once-g2")
    warm.offer(group, 1000)
    redis_conn.set(keys.group_idle(group.group_id), "1")
    redis_conn.script_load(warm._claim.script)
    dropper.armed = b"EVALSHA"
    assert warm.claim(group, "next")
    assert dropper.dropped == 1
    for rank in (0, 1):
        assert redis_conn.lrange(next_key(group.group_id, rank), 0, -1) == [b"next"]
