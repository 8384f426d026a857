"""A long document through the service (bench.long_document) at a CPU's scale: a tiny Qwen2
at 16K tokens is admitted within its estimate, reports an ETA while it prefills, resumes from a
checkpoint after its rank is killed, and answers a second question from the kept prefix in
memory. Figures (the ETA's error, the ratios) are the bench's to report, not asserted here."""

import pytest

from bench.long_document import measure


@pytest.mark.slow
def test_a_long_document_is_paced_checkpointed_resumed_and_asked_again(monkeypatch):
    monkeypatch.setenv("RINGQ_CHECKPOINT_AFTER_S", "0")  # a CPU-short prefill checkpoints too
    report = measure(
        {"model": "random:tiny-qwen2", "tokens": 16384, "nodes": 1, "kill_at": 0.8,
         "peak_tflops": 0.0}
    )  # fmt: skip
    assert report["prompt_tokens"] >= 16384
    assert report["measured_peak_bytes"] <= report["predicted_peak_bytes"]
    assert report["eta_samples"] > 0
    assert 0 < report["resumed_from_tokens"] <= report["killed_at_tokens"]
    assert report["checkpoint_read_s"] > 0
    assert report["restart_s"] > report["resume_s"] > 0  # here a resume redoes less than all
    # a causal prompt's last fifth holds more than a fifth of its FLOPs
    assert 0.2 < report["prefill_share_after_kill"] < 0.5
    assert report["second_question_cached_tokens"] >= 0.99 * report["prompt_tokens"] - 64
    assert "memory" in report["second_question_cache_source"]
