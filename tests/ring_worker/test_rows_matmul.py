import mlx.core as mx
import mlx.nn as nn
import pytest

from ring_worker.rows_matmul import (
    kernel_fits,
    kernel_matmul,
    kernels_available,
    linear,
    rows_linear,
)


@pytest.mark.parametrize(
    ("rows", "shape", "dtype", "fits"),
    [
        (2, (6144, 4096), mx.bfloat16, True),
        (8, (4096, 14336), mx.bfloat16, True),
        (1, (4096, 4096), mx.bfloat16, False),  # one row: MLX's gemv
        (9, (4096, 4096), mx.bfloat16, False),  # past the kernel's tile: cuBLASLt
        (4, (4096, 4095), mx.float32, False),  # a weight row not in 16-byte loads
        (4, (4096, 1004), mx.float32, True),
        (4, (4095, 4096), mx.bfloat16, False),  # outputs not in pairs
        (4, (4096, 4096), mx.int32, False),
    ],
)
def test_kernel_fits(rows, shape, dtype, fits):
    assert kernel_fits(rows, mx.zeros(shape, dtype=dtype), dtype) is fits


def test_a_weight_of_another_dtype_is_not_taken():
    assert not kernel_fits(4, mx.zeros((64, 64), dtype=mx.float16), mx.bfloat16)


def test_rows_linear_is_the_product_with_its_bias():
    x = mx.random.normal((3, 1, 64))
    weight, bias = mx.random.normal((32, 64)), mx.random.normal((32,))
    assert mx.allclose(rows_linear(x, weight), x @ weight.T, atol=1e-5)
    assert mx.allclose(rows_linear(x, weight, bias), x @ weight.T + bias, atol=1e-5)


def test_linear_takes_plain_and_quantised_modules():
    x = mx.random.normal((4, 1, 64))
    plain = nn.Linear(64, 32)
    assert mx.allclose(linear(plain, x), plain(x), atol=1e-5)
    quantised = nn.QuantizedLinear(64, 32, bias=False)
    assert mx.allclose(linear(quantised, x), quantised(x))


@pytest.mark.skipif(not kernels_available(), reason="the kernel runs on MLX's CUDA backend only")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows", [2, 3, 5, 8])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (6, 1000)])
def test_the_kernel_matches_the_matmul(dtype, rows, shape):
    outputs, inputs = shape
    x = mx.random.normal((rows, inputs)).astype(dtype)
    weight = (mx.random.normal(shape) * inputs**-0.5).astype(dtype)
    want = (x @ weight.T).astype(mx.float32)
    have = kernel_matmul(x, weight).astype(mx.float32)
    tolerance = 1e-4 if dtype == mx.float32 else 2e-2
    assert (mx.abs(have - want).max() / mx.abs(want).max()).item() <= tolerance
