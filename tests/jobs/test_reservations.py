"""Memory reservations in a real Redis: all-or-nothing across nodes, leases that expire, and no
over-commit however many dispatchers reserve at once."""

import random
import threading
import time

import pytest

from jobs.redis_server import connect
from jobs.reservations import Reservations

MIB = 1024**2


@pytest.fixture
def reservations(redis_conn):
    return Reservations(redis_conn, lease_s=30)


def test_reserve_up_to_capacity_then_refuse_with_a_reason(reservations):
    assert reservations.reserve("g1", {"n0": (600 * MIB, 1000 * MIB)}) is None
    why = reservations.reserve("g2", {"n0": (500 * MIB, 1000 * MIB)})
    assert why == (
        "n0 has 0.59 GiB of 0.98 GiB reserved by running groups; this job needs 0.49 GiB there"
    )
    assert reservations.reserved_bytes("n0") == 600 * MIB


def test_a_group_is_reserved_on_every_node_or_on_none(reservations):
    assert reservations.reserve("big", {"n1": (900 * MIB, 1000 * MIB)}) is None
    needs = {"n0": (200 * MIB, 1000 * MIB), "n1": (200 * MIB, 1000 * MIB)}
    assert reservations.reserve("ring", needs) is not None
    assert reservations.reserved_bytes("n0") == 0  # nothing left behind on the node that had room
    reservations.release("big", "n1")
    assert reservations.reserve("ring", needs) is None
    assert reservations.reserved_bytes("n0") == reservations.reserved_bytes("n1") == 200 * MIB


def test_an_unrenewed_lease_expires_and_a_renewed_one_does_not(redis_conn):
    lease_s = 1.0
    short = Reservations(redis_conn, lease_s=lease_s)
    reserved_at = time.monotonic()  # before: the lease runs from inside reserve()
    assert short.reserve("crashed", {"n0": (1, 10)}) is None
    assert short.reserve("alive", {"n0": (1, 10)}) is None
    # Renew "alive" until "crashed" expires: gaps between renewals may stretch to most of the
    # lease on a loaded machine and "alive" still lives.
    while short.reserved_bytes("n0") == 2:
        assert time.monotonic() - reserved_at < 10 * lease_s, "the unrenewed lease never expired"
        short.renew("alive", "n0")
        time.sleep(0.05)
    assert time.monotonic() - reserved_at >= lease_s  # not before its lease ran out
    assert short.reserved_bytes("n0") == 1  # "crashed" expired, "alive" did not
    assert short.reserve("next", {"n0": (9, 10)}) is None  # and its bytes were purged


def test_concurrent_dispatchers_never_over_commit(redis_url, redis_conn):
    capacity, nodes = 1000, ("n0", "n1", "n2")
    peaks: list[int] = []
    admitted = [0]
    lock = threading.Lock()

    def dispatcher(seed: int) -> None:
        rng, conn = random.Random(seed), connect(redis_url)
        mine = Reservations(conn, lease_s=30)
        for attempt in range(60):
            chosen = rng.sample(nodes, rng.randint(1, 3))
            group = f"d{seed}-{attempt}"
            needs = {name: (rng.randint(100, 600), capacity) for name in chosen}
            if mine.reserve(group, needs) is None:
                seen = [mine.reserved_bytes(name) for name in nodes]
                with lock:
                    peaks.append(max(seen))
                    admitted[0] += 1
                time.sleep(rng.random() * 0.005)
                for name in chosen:
                    mine.release(group, name)
        conn.close()

    threads = [threading.Thread(target=dispatcher, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert admitted[0] > 50, "the test must admit many groups to mean anything"
    assert max(peaks) <= capacity
    assert all(Reservations(redis_conn, 30).reserved_bytes(name) == 0 for name in nodes)
