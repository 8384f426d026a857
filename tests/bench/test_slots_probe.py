"""bench.probes.slots --shrink on a tiny model: half the rows leave, the buffers halve in the call
they leave in, and the probe finds that call and reads the gaps around it."""

from bench.probes.slots import shrink_gaps
from ring_worker.engine.engines import Engine
from tests.ring_worker.equivalence_rank import prompt_tokens
from tests.ring_worker.tiny import load_tiny, save_tiny


def test_the_shrink_probe_reads_the_gaps_around_the_halving(tmp_path):
    engine = Engine(load_tiny(save_tiny(tmp_path, "llama", layers=2)))
    prefills = [engine.prefill(prompt_tokens(20 + 3 * row), 64) for row in range(8)]
    found = shrink_gaps(engine, prefills, 10)
    assert found["slots"] == [8, 4] and len(found["at_ms"]) == 3
    assert found["before_ms"] > 0 and found["after_ms"] > 0
