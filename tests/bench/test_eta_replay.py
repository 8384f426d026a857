"""bench.probes.eta_replay reads the chunk ends a rank logs and replays the rank's ETA over them:
chunks timed exactly by the cost model give estimates that match the time left, and a prefill
that slows half-way shows the error the estimator cannot foresee."""

from bench.probes.eta_replay import chunk_ends, replay


def cost(start: int, end: int) -> float:  # a·tokens + b·(end² − start²)
    return (end - start) + 1e-3 * (end * end - start * start)


def log_line(job: str, seconds_at) -> str:
    points = " ".join(f"{t}:{seconds_at(t):.6f}" for t in range(0, 32769, 1024))
    return f"INFO job {job}: prefill chunks ended (tokens:s) {points}\n"


def test_a_logged_prefill_timed_by_its_cost_replays_without_error():
    text = "other line\n" + log_line("abc123", lambda t: cost(0, t) / 1e4)
    [(job, points)] = chunk_ends(text)
    assert job == "abc123" and points[0] == (0, 0.0) and points[-1][0] == 32768
    errors = replay(cost, points)
    assert errors and max(errors) < 1e-3


def test_a_prefill_that_slows_half_way_is_replayed_with_the_error_it_shows():
    def seconds_at(t: int) -> float:  # twice as slow past 16K tokens
        half = 16384
        return (cost(0, min(t, half)) + 2 * cost(half, max(t, half))) / 1e4

    [(_, points)] = chunk_ends(log_line("def456", seconds_at))
    errors = replay(cost, points)
    assert max(errors) > 0.2
