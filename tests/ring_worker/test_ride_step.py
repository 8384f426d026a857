"""A joiner's prompt prefilled in chunks riding on a decode batch's steps
(ring_worker/ride_step.py), on the CPU in float32: every member's logits at every step, the
riders' included once they decode, stay within 1e-4 of each sequence alone through plain mlx-lm,
and the greedy tokens are the same. Riders of different lengths join at different steps, one
rides while another member leaves, one outlives every member it rode with (its last chunks run
alone), and a short one joins a long one. Run plain (masked attention) and as on CUDA (rows
attention routed to `reference_attention`, linears fused, steps of several rows compiled)."""

import mlx.core as mx
import pytest

from ring_worker.batch_decode import BatchDecoder, DecodeRequest, SequenceResult
from ring_worker.engine import Engine
from ring_worker.fused_linears import fuse_layers
from ring_worker.rows_attention import install_rows_attention, reference_attention
from tests.ring_worker.batch_rank import Entry
from tests.ring_worker.equivalence_rank import prompt_tokens
from tests.ring_worker.test_batch_decode import LOGITS_ATOL, alone
from tests.ring_worker.tiny import load_tiny

RIDE_CHUNK = 64
# "first" joins alone (plain prefill); the others ride on the batch's steps: "mid" (3 chunks),
# "short" (one 3-token chunk) while "mid" is a member, "long" (8 chunks) until after "first"
# and "short" have left, so its last chunks run alone.
RIDERS = (
    Entry("first", 300, 12, 0),
    Entry("mid", 150, 10, 1),
    Entry("short", 3, 6, 2),
    Entry("long", 500, 10, 4),
)


def run_riding(engine: Engine, compiled: bool | None = None):
    seen: dict[str, list[mx.array]] = {}

    def record(keys: list[str], logits: mx.array) -> None:
        mx.eval(logits)
        for row, key in enumerate(keys):
            seen.setdefault(key, []).append(logits[row])

    decoder = BatchDecoder(engine, on_logits=record, compiled=compiled)
    results: list[SequenceResult] = []
    rode: dict[str, int] = {}

    def rider(key: str):
        def ride(chunk: list[int], cache: list) -> mx.array:
            rode[key] = rode.get(key, 0) + bool(decoder.busy)
            left, hidden = decoder.ride(chunk, cache)
            results.extend(left)
            return hidden

        return ride

    step = 0
    while step <= max(e.join_step for e in RIDERS) or decoder.busy:
        for entry in RIDERS:
            if entry.join_step == step:
                ride = rider(entry.key) if decoder.busy else None
                prefill = engine.prefill(prompt_tokens(entry.prompt_tokens), RIDE_CHUNK, ride=ride)
                decoder.add(DecodeRequest(entry.key, entry.max_tokens), prefill)
        results.extend(decoder.step())
        step += 1
    return seen, results, rode


def routed_engine(model_dir) -> Engine:
    model = load_tiny(model_dir)
    assert install_rows_attention(model, attend=reference_attention)
    assert fuse_layers(model)
    return Engine(model)


@pytest.mark.parametrize("route", ["plain", "rows"])
def test_riders_match_each_sequence_alone(tiny_model_dir, route):
    if route == "plain":
        engine, compiled = Engine(load_tiny(tiny_model_dir)), None
    else:
        engine, compiled = routed_engine(tiny_model_dir), True
    seen, results, rode = run_riding(engine, compiled)
    tokens = {r.key: r.tokens for r in results}
    for entry in RIDERS:
        want_tokens, want_logits = alone(tiny_model_dir, entry.prompt_tokens, entry.max_tokens)
        got = seen[entry.key]
        assert len(got) == entry.max_tokens, entry.key
        for step, (have, want) in enumerate(zip(got, want_logits, strict=True)):
            delta = mx.abs(have - want).max().item()
            assert delta <= LOGITS_ATOL, f"{entry.key} step {step}: max |dlogits| {delta}"
        assert tokens[entry.key] == want_tokens, entry.key
    # the schedule really rode: "mid" on all its chunks, "long" on some but not all
    assert rode == {"mid": 3, "short": 1, "long": rode["long"]}, rode
    assert 0 < rode["long"] < 8, rode
