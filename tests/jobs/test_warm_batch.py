"""A busy warm group takes more jobs while its batch has room and its nodes' memory allows
(jobs/warm_groups.py `join`), its ranks take them between decode steps, the same words on every
rank (`joined`), and a lost group retries every job of its batch (jobs/recovery.py)."""

from admission.estimate import BatchRow
from jobs import keys
from jobs.lifecycle import JobState
from jobs.recovery import reconcile, track_group
from jobs.reservations import Reservations
from jobs.schemas import GroupSpec, JobKind, JobSpec, Placement
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.warm_groups import WarmGroups, idle_key, next_key


def two_ranks(group_id: str = "g1") -> GroupSpec:
    return GroupSpec(
        group_id=group_id,
        job_id="first",
        model="smollm2",
        addresses=["127.0.0.1:1", "127.0.0.1:2"],
        nodes=["n0", "n1"],
    )


def busy(warm: WarmGroups, group: GroupSpec) -> None:
    warm.offer(group, 1000)
    warm.started(group, group.job_id)


def test_a_busy_group_takes_jobs_up_to_the_limit(redis_conn):
    warm, group = WarmGroups(redis_conn), two_ranks()
    busy(warm, group)
    assert warm.join(group, "second", max_batch=3) == "joined"
    assert warm.join(group, "third", max_batch=3) == "joined"
    assert warm.join(group, "fourth", max_batch=3) == "no"  # full
    warm.ended(group, "first")
    assert warm.join(group, "fourth", max_batch=3) == "joined"
    assert warm.batch(group.group_id) == ["fourth", "second", "third"]
    for rank in (0, 1):
        words = redis_conn.lrange(next_key(group.group_id, rank), 0, -1)
        assert words == [b"second", b"third", b"fourth"]


def test_max_batch_one_never_joins_a_busy_group(redis_conn):
    warm, group = WarmGroups(redis_conn), two_ranks()
    busy(warm, group)
    assert warm.join(group, "second", max_batch=1) == "no"


def test_idle_retired_and_unoffered_groups_are_not_joined(redis_conn):
    warm = WarmGroups(redis_conn)
    never_offered = two_ranks("g0")
    warm.started(never_offered, "first")
    assert warm.join(never_offered, "x", max_batch=8) == "no"
    idle = two_ranks("g1")
    warm.offer(idle, 1000)
    redis_conn.set(idle_key(idle.group_id), "1")
    assert warm.join(idle, "x", max_batch=8) == "no"  # an idle group is claimed, not joined
    assert warm.claim(idle, "x")
    assert warm.join(idle, "y", max_batch=8) == "joined"  # claimed: busy now
    redis_conn.hdel(keys.WARM_GROUPS, idle.group_id)  # retired
    assert warm.join(idle, "z", max_batch=8) == "no"


def test_every_rank_takes_the_same_words(redis_conn):
    warm, group = WarmGroups(redis_conn), two_ranks()
    busy(warm, group)
    for job in ("a", "b"):
        assert warm.join(group, job, max_batch=8) == "joined"
    counts: list[int] = []

    def agree(count: int) -> int:  # rank 0's count reaches every rank (a collective in ranks)
        counts.append(count)
        return counts[0]

    assert warm.joined(group, 0, agree) == ["a", "b"]
    assert warm.joined(group, 1, agree) == ["a", "b"]
    assert warm.joined(group, 0, lambda n: n) == []


def test_rank_0_takes_every_job_handed_over_and_every_rank_the_same(redis_conn):
    """Between two steps, rank 0 takes all the jobs the dispatcher handed to the group (at most
    the batch's free rows were handed), in order, and one count tells the other ranks."""
    warm, group = WarmGroups(redis_conn), two_ranks()
    busy(warm, group)
    for job in ("a", "b", "c"):
        assert warm.join(group, job, max_batch=8) == "joined"
    taken = {rank: warm.joined(group, rank, lambda n: 3) for rank in (0, 1)}
    assert taken == {0: ["a", "b", "c"], 1: ["a", "b", "c"]}
    assert warm.joined(group, 0, lambda n: n) == []


def test_joining_grows_the_reservation_to_the_batch_buffer_or_is_refused(redis_conn):
    """The reservation grows to the buffer after the join: every row as long as the longest,
    rows doubling (tests/jobs/test_batch_buffer_accounting.py checks it against the real
    allocation); a row that fits a free one adds nothing; the last job out gives it back."""
    warm, group = WarmGroups(redis_conn), two_ranks()
    warm.offer(group, 1000)
    warm.started(group, group.job_id, BatchRow(256, 0))
    reservations = Reservations(redis_conn, lease_s=30)
    base = {node: (1000, 6000) for node in group.nodes}
    assert reservations.reserve(group.group_id, base) is None
    assert reservations.reserve("other", {"n1": (2000, 6000)}) is None
    budget = {node: 6000 for node in group.nodes}

    def join(job: str, row_bytes: int, row_tokens: int) -> str:
        return warm.join(group, job, 8, row_bytes, budget, BatchRow(row_tokens, 0))

    def held() -> list[int]:
        return [reservations.held(n)[group.group_id] for n in group.nodes]

    assert join("a", 600, 256) == "joined"  # 2 rows of 256 positions
    assert held() == [2200, 2200]
    # 4 rows (doubled) of 512 positions: 4800; n1: 2000 (other) + 1000 + 4800 > 6000
    assert join("b", 1200, 512) == "no-memory"
    assert redis_conn.llen(next_key(group.group_id, 0)) == 1  # "b" was not handed over
    assert join("b", 600, 256) == "joined"  # 4 rows of 256: 2400
    assert held() == [3400, 3400]
    assert join("c", 600, 256) == "joined" and held() == [3400, 3400]  # a free row
    assert warm.batch(group.group_id) == ["a", "b", "c", "first"]
    for job in ("a", "b", "c"):
        warm.ended(group, job)
        assert held() == [3400, 3400]  # the buffer keeps its size while the batch runs
    warm.ended(group, "first")
    assert held() == [1000, 1000] and warm.buffer(group.group_id).slots == 0
    warm.started(group, "next", BatchRow(256, 0))  # the group's next batch starts afresh
    assert join("d", 600, 256) == "joined" and held() == [2200, 2200]
    reservations.release(group.group_id, "n0")  # the group is gone from n0: nothing to grow
    assert join("e", 600, 256) == "no"


def test_a_lost_group_retries_every_job_of_its_batch_once(redis_conn, short_tmp_path):
    """The reconciler finds a group with a dead node: each live job of its batch is retried
    once; the one that had finished is left alone; a second pass retries nothing."""
    store, warm = JobStore(redis_conn), WarmGroups(redis_conn)
    settings = Settings(home=short_tmp_path, redis_url=None, max_retries=2)
    group = two_ranks()
    spec = JobSpec(kind=JobKind.GENERATE, document="x", model="random:tiny-llama")
    placement = Placement(
        strategy="ring", ranks=2, nodes=group.nodes, group_id="g1", bytes_per_node=1
    )
    for job_id in ("first", "second", "done"):
        store.create(job_id, spec)
        store.transition(job_id, JobState.ADMITTED, placement=placement)
        warm.started(group, job_id)
    store.transition("done", JobState.FAILED, error="ended before the group was lost")
    track_group(redis_conn, group)  # n0 and n1 never registered: dead nodes
    assert reconcile(redis_conn, settings) == ["g1"]
    for job_id in ("first", "second"):
        record = store.get(job_id)
        assert record.state == JobState.QUEUED and record.attempt == 1
        assert "stopped answering" in record.retry_reasons[0]
    assert store.get("done").state == JobState.FAILED
    assert warm.batch("g1") == [] and reconcile(redis_conn, settings) == []
    assert [store.get(j).attempt for j in ("first", "second")] == [1, 1]
