"""bench.probes.join_memory on a tiny model: a join that grows the batch's buffers peaks at
about the new buffers the workload floor counts for it (the copies of the old ones die as they
are made), and a join that fits the buffers it finds allocates nearly nothing."""

import json

from click.testing import CliRunner

from bench.probes.join_memory import main


def test_a_join_peaks_at_the_buffers_the_floor_counts():
    result = CliRunner().invoke(main, ["--lengths", "300,900,600,1800", "--chunk-tokens", "256"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    grows, fits = rows[1], rows[2]  # 900 outgrows one slot of 316; 600 fits two of 916
    assert 0.9 < grows["peak_over_counted"] < 1.2
    assert fits["peak_above_bytes"] < 0.05 * fits["counted_bytes"]
