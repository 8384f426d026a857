"""Where a long prompt's MLX peak goes on one GPU, prefill and decode apart: admission's estimate
beside the measured peak, for the Qwen2.5-1M shape (whose 524K-token peak ran 17 % over the
estimate, and whose first decode step ran out of memory).

    python -m bench.probes.long_peak --model random:qwen2.5-7b-1m --tokens 131072,262144
"""

import argparse
import json
import time

import mlx.core as mx

from admission.estimate import Layout, estimate_node_bytes
from jobs.model_catalog import read_model_shape, resolve_model
from ring_worker.engine.engines import Engine
from ring_worker.engine.models import load_model

CHUNK_TOKENS = 16384


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen2.5-7b-1m")
    parser.add_argument("--tokens", default="131072,262144")
    args = parser.parse_args()
    source = resolve_model(args.model, allowed_dirs=None)
    shape = read_model_shape(source)
    engine = Engine(load_model(source))
    mx.eval(engine.model.parameters())
    rows: dict[str, object] = {"weights_bytes": mx.get_active_memory()}
    for tokens in (int(t) for t in args.tokens.split(",")):
        estimate = estimate_node_bytes(
            shape, tokens, 4, Layout("single", 1), CHUNK_TOKENS, dense_weights=False
        )
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        began = time.perf_counter()
        prefill = engine.prefill([7] * tokens, CHUNK_TOKENS)
        mx.synchronize()
        row = {
            "estimate_bytes": estimate.total_bytes,
            "prefill_s": time.perf_counter() - began,
            "prefill_peak_bytes": mx.get_peak_memory(),
            "after_prefill_bytes": mx.get_active_memory(),
        }
        mx.reset_peak_memory()
        engine.decode(prefill, 4)
        mx.synchronize()
        row["decode_peak_bytes"] = mx.get_peak_memory()
        rows[str(tokens)] = row
        print(tokens, json.dumps(row), flush=True)
        del prefill
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
