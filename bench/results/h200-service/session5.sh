set -u
python3 - <<'PY' || { echo KERNEL-CHECK-FAILED; exit 3; }
import mlx.core as mx
from ring_worker.rows_linear import rows_kernel
for dt in (mx.bfloat16, mx.float16, mx.float32):
    for m, k, n in ((2, 4096, 4096), (3, 4096, 1000), (8, 14336, 4096), (5, 64, 7), (16, 256, 33)):
        x = mx.random.normal((m, k)).astype(dt); w = (mx.random.normal((n, k)) * k**-0.5).astype(dt)
        ref = (x.astype(mx.float32) @ w.astype(mx.float32).T)
        got = rows_kernel(x, w).astype(mx.float32)
        print(dt, m, k, n, "max err", mx.abs(got - ref).max().item(), "ref max", mx.abs(ref).max().item())
PY
STEP_ROWS=1,2,4,8,16,32 STEP_TIMEOUT=200 bash bench/results/h200-service/run.sh step-cost
RINGQ_MAX_SLOWDOWN=1.5 BATCH_TAG=-rows-linear-slowdown-1.5 BATCH_TIMEOUT=220 bash bench/results/h200-service/run.sh batch
BATCH_TAG=-rows-linear-defaults BATCH_TIMEOUT=220 bash bench/results/h200-service/run.sh batch
