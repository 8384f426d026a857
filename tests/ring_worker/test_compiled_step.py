"""A decode batch's step compiled layer by layer (ring_worker/engine/compiled_step.py), on the CPU
with
the rows attention routed to `reference_attention` and the linears fused, as on CUDA: each
sequence's logits stay within 1e-4 (float32) of it alone through plain mlx-lm over the fidelity
schedule (joins at different steps and lengths, a leave, a short row joining a long one, buffers
growing), the buffers are written in place, and a trace serves many steps."""

import mlx.core as mx
import pytest

from ring_worker.engine.batch_cache import grown_slots
from ring_worker.engine.batch_decode import BatchDecoder
from ring_worker.engine.compiled_step import CompiledStep
from ring_worker.engine.engines import Engine
from ring_worker.engine.fused_linears import fuse_layers
from ring_worker.engine.rows_attention import (
    install_rows_attention,
    reference_attention,
    split_bucket,
    split_count,
)
from tests.ring_worker.batch_rank import run_schedule
from tests.ring_worker.test_batch_decode import check_against_alone, request
from tests.ring_worker.tiny import load_tiny


def routed_engine(model_dir) -> Engine:
    model = load_tiny(model_dir)
    assert install_rows_attention(model, attend=reference_attention)
    assert fuse_layers(model)
    return Engine(model)


def test_a_compiled_batch_matches_each_sequence_alone(tiny_model_dir, monkeypatch):
    traced: list[CompiledStep] = []
    step_call = CompiledStep.__call__

    def counted(self, cache, tokens):
        traced.append(self)
        return step_call(self, cache, tokens)

    monkeypatch.setattr(CompiledStep, "__call__", counted)
    seen, results = run_schedule(routed_engine(tiny_model_dir), compiled=True)
    check_against_alone(tiny_model_dir, seen, {r.key: r.tokens for r in results})
    assert len(traced) > 30  # the schedule's steps of several rows ran compiled
    parts = 2 * len(traced[0].model.layers)  # each layer's two compiled parts
    assert traced[0].traces < parts * len(traced) / 4, traced[0].traces  # and few retraced


def test_a_join_or_leave_does_not_retrace(tiny_model_dir):
    """Slots reserved up front stay: rows joining and leaving inside them step on one trace."""
    engine = routed_engine(tiny_model_dir)
    decoder = BatchDecoder(engine, max_batch=4, compiled=True)
    assert decoder.compiled is not None
    for key, length in (("a", 20), ("b", 30)):
        decoder.add(*request(engine, key, length, 12))
    decoder.step()
    decoder.step()
    before = decoder.compiled.traces
    decoder.add(*request(engine, "c", 25, 3))  # joins (3 rows in 4 slots), leaves after 3
    for _ in range(6):
        decoder.step()
    assert decoder.compiled.traces == before
    assert len(decoder.members) == 2


@pytest.mark.parametrize("compiled", [True, False])
def test_a_batchs_slots_double_as_rows_join_and_halve_as_they_leave(tiny_model_dir, compiled):
    """Rows join one by one and full buffers double (1, 2, 4, 8); as rows leave, the buffers
    keep their slots while more than half are used, then halve."""
    engine = routed_engine(tiny_model_dir)
    decoder = BatchDecoder(engine, compiled=compiled)
    joins = [("a",), ("b", "c"), ("d",), ("e", "f", "g")]
    for keys in joins:
        for key in keys:
            tokens = 30 if key in "efg" else 6  # the last three outlive the rest
            decoder.add(*request(engine, key, 20 + 5 * len(decoder.members), tokens))
        decoder.step()
        assert decoder.cache.slots == grown_slots(1, len(decoder.members)), keys
    assert decoder.cache.slots == 8
    while len(decoder.members) > 6:  # rows leave; the slots stay while more than half are used
        decoder.step()
    assert decoder.cache.slots == 8
    while len(decoder.members) > 3:  # then they halve
        decoder.step()
    assert decoder.cache.slots == 4


def test_a_compiled_step_writes_the_buffers_in_place(tiny_model_dir):
    """The step's K/V go into the batch's buffers without a copy of them (a copy of every
    layer's buffers a step would hold twice their memory)."""
    engine = routed_engine(tiny_model_dir)
    decoder = BatchDecoder(engine, max_batch=2, compiled=True)
    for key, length in (("a", 700), ("b", 900)):
        decoder.add(*request(engine, key, length, 40))
    decoder.step()
    mx.eval(decoder.cache.state())
    buffer_bytes = sum(a.nbytes for a in decoder.cache.state())
    mx.reset_peak_memory()
    held = mx.get_active_memory()
    for _ in range(20):
        decoder.step()
    mx.eval(decoder.cache.state())
    assert mx.get_peak_memory() - held < buffer_bytes / 2


@pytest.mark.parametrize("blocks", [1, 8, 64, 512])
def test_a_split_bucket_splits_as_its_length_does(blocks):
    for longest in range(1, 70_000, 37):
        assert split_count(blocks, split_bucket(longest)) == split_count(blocks, longest)
        assert split_bucket(longest) <= longest < 2 * split_bucket(longest)
