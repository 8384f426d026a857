"""A prefill's ETA (ring_worker/engine/eta.py): fitted to its chunks' times, it predicts the rest
of a prompt whose attention runs at a different speed per FLOP than its weights' work, where
scaling the time so far by FLOPs does not."""

import pytest

from ring_worker.engine.eta import PrefillPace, seconds_left

CHUNK, TOTAL = 16384, 1_048_576


def flops(start: int, end: int) -> float:
    """The Qwen2.5-1M shape's prompt FLOPs: 2 P per token, 2 layers d_model per token pair."""
    return 2 * 6.5e9 * (end - start) + 2 * 28 * 3584 * (end * end - start * start) / 2


def timed(per_token: float, per_square: float, upto: int, start: int = 0) -> PrefillPace:
    """A pace that saw chunks to `upto`, each taking a·n + b·(e² - s²) seconds."""
    pace = PrefillPace(flops, start)
    elapsed = 0.0
    for end in range(start, upto + 1, CHUNK):
        if end > start:
            elapsed += per_token * CHUNK + per_square * (end * end - (end - CHUNK) ** 2)
        pace.add(end, elapsed)
    return pace


def truth(per_token: float, per_square: float, done: int) -> float:
    return per_token * (TOTAL - done) + per_square * (TOTAL**2 - done**2)


def test_the_fit_predicts_the_rest_where_attention_runs_slower_than_its_flops_say():
    # the weights' work at 600 TFLOP/s; attention at a third of that per FLOP
    a, b = 2 * 6.5e9 / 600e12, 28 * 3584 / 200e12
    pace = timed(a, b, TOTAL // 10)
    done = pace.seen[-1][0]
    assert pace.seconds_left(TOTAL) == pytest.approx(truth(a, b, done), rel=1e-6)
    elapsed = pace.seen[-1][1]
    by_flops = seconds_left(flops, elapsed, 0, done, TOTAL)
    assert by_flops < 0.8 * truth(a, b, done)  # FLOPs alone: too early by over a fifth


def test_a_resumed_prefill_fits_from_where_it_resumed():
    a, b = 1e-5, 1e-11
    pace = timed(a, b, 600_000, start=409_600)
    assert pace.seconds_left(TOTAL) == pytest.approx(truth(a, b, pace.seen[-1][0]), rel=1e-6)


def test_before_three_chunks_or_with_a_negative_rate_it_scales_by_flops():
    pace = timed(1e-5, 1e-11, 2 * CHUNK)
    done, elapsed = pace.seen[-1]
    assert pace.seconds_left(TOTAL) == seconds_left(flops, elapsed, 0, done, TOTAL)
    noisy = PrefillPace(flops, 0)
    for end, at in [(0, 0.0), (CHUNK, 5.0), (2 * CHUNK, 5.1), (3 * CHUNK, 5.2), (4 * CHUNK, 5.3)]:
        noisy.add(end, at)  # the first chunk slow, the rest fast: attention's rate < 0
    assert noisy.seconds_left(TOTAL) == seconds_left(flops, 5.3, 0, 4 * CHUNK, TOTAL)
    assert PrefillPace(flops, 0).seconds_left(TOTAL) is None
