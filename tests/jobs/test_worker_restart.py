"""A service restarted with its predecessor's host name and pid (a container restarted after a
kill -9: pid 1 again) starts at once instead of RQ refusing the name until its key expires."""

from rq import Queue

from jobs.workers import service_worker


def test_a_worker_starts_under_the_name_of_its_dead_predecessor(redis_conn):
    queue = Queue("ringq:test-restart", connection=redis_conn)
    crashed = service_worker(queue, redis_conn, "node-n")
    crashed.register_birth()  # then killed: no death registered
    restarted = service_worker(queue, redis_conn, "node-n")
    assert restarted.name == crashed.name
    restarted.register_birth()  # RQ: "There exists an active worker named ... already" before
    assert redis_conn.hexists(restarted.key, "birth")
    assert not redis_conn.hexists(restarted.key, "death")
    restarted.register_death()
