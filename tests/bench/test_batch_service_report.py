"""bench.batch_service's bursts and references: documents that never repeat (a repeat's KV would
be reused) with the k-th of every burst as long, and each job's one-at-a-time reference as the
median over bursts, worked out by hand."""

import pytest

from bench.batch_service import compare, documents, median_service_s
from jobs.model_catalog import resolve_model
from jobs.tokenizer import load_tokenizer


def test_bursts_hold_other_documents_each_as_long_as_its_place_in_the_first():
    tokenizer = load_tokenizer(resolve_model("random:tiny-llama", allowed_dirs=None))
    bursts = documents(tokenizer, 6, 300, rounds=3)
    assert [len(burst) for burst in bursts] == [6, 6, 6]
    texts = [text for burst in bursts for text in burst]
    assert len(set(texts)) == len(texts)
    lengths = [[len(tokenizer.encode(t, add_special_tokens=False)) for t in b] for b in bursts]
    bodies = [[n - len(tokenizer.encode(f"Document {r * 6 + k}. ", add_special_tokens=False))
               for k, n in enumerate(row)] for r, row in enumerate(lengths)]  # fmt: skip
    assert bodies[0] == bodies[1] == bodies[2]
    assert bodies[0][0] > bodies[0][4]  # lengths differ within a burst


def burst(latencies: list[float], service: list[float], decode_tok_s: float) -> dict:
    return {
        "latencies_s": latencies,
        "service_s": service,
        "decode_tok_s": decode_tok_s,
        "makespan_s": max(latencies),
        "texts": ["a", "b"],
    }


def test_a_burst_is_judged_against_its_own_and_the_median_reference():
    """Job 0 took 2.0, 1.5 and 2.5 s alone in three bursts: the median is 2.0. Batched at 3.0 s
    it is 2.0x the second burst's own reference, 1.5x the median."""
    alone = [burst([2.0, 4.0], [2.0, 2.0], 10.0), burst([1.5, 3.5], [1.5, 2.0], 10.0),
             burst([2.5, 4.5], [2.5, 2.0], 10.0)]  # fmt: skip
    assert median_service_s(alone) == [2.0, 2.0]
    found = compare(burst([3.0, 3.2], [3.0, 3.2], 80.0), alone[1], median_service_s(alone))
    assert found["decode_tok_s"] == 8.0
    assert found["worst_latency"] == pytest.approx(3.0 / 1.5)
    assert found["worst_latency_median_reference"] == pytest.approx(1.5)
    assert found["worst_job_median_reference"] == 0
    assert found["identical_texts"] == found["compared_texts"] == 2
