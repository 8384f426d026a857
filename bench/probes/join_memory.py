"""What a join to a decode batch holds at its peak, against what bench.workload_floor counts
for it: prompts of `--lengths` tokens are prefilled and join one BatchDecoder in turn (copied,
not moved, as the floor joins a document's questions). Before each join the device is
synchronised and MLX's cache of freed buffers dropped; the join's peak above the memory then
in use is held against the new buffers the floor counts (slots grown as needed x the longest
row x the KV bytes per token).

    python -m bench.probes.join_memory --model random:tiny-llama --lengths 1000,3000,2000,6000
    python -m bench.probes.join_memory --model random:llama-3.1-8b --lengths 40000,12000,60000
"""

import json

import click


@click.command()
@click.option("--model", default="random:tiny-llama", show_default=True)
@click.option("--lengths", default="1000,3000,2000,6000,500,8000", show_default=True)
@click.option("--max-tokens", default=16, show_default=True, help="Each row's room to decode.")
@click.option("--chunk-tokens", default=4096, show_default=True)
def main(model: str, lengths: str, max_tokens: int, chunk_tokens: int) -> None:
    import mlx.core as mx

    from bench.workload_floor import join_bytes, kv_bytes_per_token
    from jobs.model_catalog import resolve_model
    from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest
    from ring_worker.engine.engines import Engine
    from ring_worker.engine.models import load_for_this_device

    engine = Engine(load_for_this_device(resolve_model(model, allowed_dirs=None)))
    decoder = BatchDecoder(engine, max_batch=len(lengths.split(",")))
    held: list[int] = []
    for row, length in enumerate(int(n) for n in lengths.split(",")):
        prefill = engine.prefill([1] * length, chunk_tokens)
        held.append(length + max_tokens)
        counted = join_bytes(decoder.cache.slots, held, kv_bytes_per_token(prefill.cache))
        mx.synchronize()
        mx.clear_cache()
        active = mx.get_active_memory()
        mx.reset_peak_memory()
        decoder.add(DecodeRequest(str(row), max_tokens), prefill)
        mx.eval(decoder.cache.state())
        mx.synchronize()
        above = mx.get_peak_memory() - active
        del prefill
        click.echo(json.dumps({
            "row": row, "tokens": length, "active_before_bytes": active,
            "counted_bytes": counted, "peak_above_bytes": above,
            "peak_over_counted": round(above / counted, 3),
        }))  # fmt: skip


if __name__ == "__main__":
    from bench.decode_throughput import reexec_with_openblas

    reexec_with_openblas("bench.probes.join_memory")
    main()
