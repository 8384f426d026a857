"""Decode-step linears through gather_mm (ring_worker/rows_linear.py).

MLX runs gather_mm on the CPU too, so the routed layers are forced on here and checked against
plain mlx-lm, each sequence alone, over the fidelity schedule (rows of different lengths
joining at different steps; the logits tolerance is check_against_alone's, 1e-4 in float32)."""

import mlx.core as mx
import mlx.nn as nn

from ring_worker.engine import Engine
from ring_worker.rows_linear import MAX_ROWS, RowsLinear, install_rows_linear
from tests.ring_worker.batch_rank import run_schedule
from tests.ring_worker.test_batch_decode import check_against_alone
from tests.ring_worker.test_rows_attention import tiny_model_dir  # noqa: F401 (fixture)
from tests.ring_worker.tiny import load_tiny


def test_routed_linears_match_each_sequence_alone(tiny_model_dir):  # noqa: F811
    model = load_tiny(tiny_model_dir)
    linears = sum(type(m) is nn.Linear for _, m in model.named_modules())
    weights = {id(m.weight) for _, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert install_rows_linear(model, force=True) == linears > 0
    assert install_rows_linear(model, force=True) == linears  # again: nothing re-wrapped
    routed = [m for _, m in model.named_modules() if isinstance(m, RowsLinear)]
    assert len(routed) == linears and not any(type(m) is nn.Linear for m in routed)
    assert {id(m.weight) for m in routed} <= weights  # the same arrays, nothing copied
    seen, results = run_schedule(Engine(model))
    check_against_alone(tiny_model_dir, seen, {r.key: r.tokens for r in results})


def test_only_decode_steps_of_several_rows_take_the_gather_path():
    plain = nn.Linear(32, 48, bias=True)
    routed = RowsLinear(plain)
    gathers = []
    real = mx.gather_mm

    def counted(*args, **kwargs):
        gathers.append(args[0].shape)
        return real(*args, **kwargs)

    mx.gather_mm = counted
    try:
        for shape in [(1, 1, 32), (3, 1, 32), (MAX_ROWS, 1, 32), (MAX_ROWS + 1, 1, 32),
                      (1, 7, 32), (2, 5, 32)]:  # fmt: skip
            x = mx.random.normal(shape)
            assert mx.allclose(routed(x), plain(x), atol=1e-5), shape
    finally:
        mx.gather_mm = real
    assert gathers == [(3, 1, 32), (MAX_ROWS, 1, 32)]


def test_without_cuda_nothing_is_routed_unless_forced():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    expected = 2 if mx.cuda.is_available() and mx.default_device() == mx.gpu else 0
    assert install_rows_linear(model) == expected
