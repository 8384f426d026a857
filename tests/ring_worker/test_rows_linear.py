"""Decode-step linears of a few rows (ring_worker/rows_linear.py).

The kernel runs on CUDA only (bench.step_cost_probe checks it against MLX's matmul there); here
the routed layers take an MLX reference product on the CPU, and are checked against plain
mlx-lm, each sequence alone, over the fidelity schedule (rows of different lengths joining at
different steps; the logits tolerance is check_against_alone's, 1e-4 in float32)."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from ring_worker.engine import Engine
from ring_worker.rows_linear import MAX_ROWS, RowsLinear, fits, install_rows_linear
from tests.ring_worker.batch_rank import run_schedule
from tests.ring_worker.test_batch_decode import check_against_alone
from tests.ring_worker.test_rows_attention import tiny_model_dir  # noqa: F401 (fixture)
from tests.ring_worker.tiny import load_tiny


def reference(x: mx.array, weight: mx.array) -> mx.array:
    return x @ weight.T


def test_routed_linears_match_each_sequence_alone(tiny_model_dir):  # noqa: F811
    model = load_tiny(tiny_model_dir)
    linears = sum(type(m) is nn.Linear for _, m in model.named_modules())
    weights = {id(m.weight) for _, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert install_rows_linear(model, reference) == linears > 0
    assert install_rows_linear(model, reference) == linears  # again: nothing re-wrapped
    routed = [m for _, m in model.named_modules() if isinstance(m, RowsLinear)]
    assert len(routed) == linears and not any(type(m) is nn.Linear for m in routed)
    assert {id(m.weight) for m in routed} <= weights  # the same arrays, nothing copied
    seen, results = run_schedule(Engine(model))
    check_against_alone(tiny_model_dir, seen, {r.key: r.tokens for r in results})


def test_only_calls_of_a_few_rows_take_the_product():
    plain = nn.Linear(32, 48, bias=True)
    calls = []

    def counted(x, weight):
        calls.append(x.shape)
        return reference(x, weight)

    routed = RowsLinear(plain, counted)
    for shape in [(1, 1, 32), (3, 1, 32), (MAX_ROWS, 1, 32), (MAX_ROWS + 1, 1, 32),
                  (1, 7, 32), (1, 300, 32), (2, 2, 32)]:  # fmt: skip
        x = mx.random.normal(shape)
        assert mx.allclose(routed(x), plain(x), atol=1e-5), shape
    assert calls == [(3, 32), (MAX_ROWS, 32), (7, 32), (4, 32)]  # flattened to (rows, dims)


@pytest.mark.parametrize(
    ("rows", "dims", "x_dtype", "w_dtype", "taken"),
    [
        (2, 64, mx.bfloat16, mx.bfloat16, True),
        (2, 64, mx.float32, mx.float32, True),
        (2, 4, mx.float32, mx.float32, True),  # 16 bytes of dims
        (2, 6, mx.float32, mx.float32, False),  # not whole 16-byte chunks
        (2, 12, mx.bfloat16, mx.bfloat16, False),
        (2, 64, mx.float32, mx.bfloat16, False),  # mixed dtypes: MLX promotes, the kernel not
        (2, 64, mx.int32, mx.int32, False),
        (1, 64, mx.bfloat16, mx.bfloat16, False),  # one row: MLX's gemv
    ],
)
def test_fits(rows, dims, x_dtype, w_dtype, taken):
    x = mx.zeros((rows, 1, dims), x_dtype)
    assert fits(x, mx.zeros((16, dims), w_dtype)) is taken


def test_without_cuda_nothing_is_routed():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    expected = 2 if mx.cuda.is_available() and mx.default_device() == mx.gpu else 0
    assert install_rows_linear(model) == expected
