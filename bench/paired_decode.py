"""Paired comparisons for bench/decode_throughput.py: ours and mlx-lm's decoders alive side by side,
stepping in alternating blocks of BLOCK_STEPS (each block ends synchronised, its first step is not
timed), so that a shared machine's changing load touches both alike."""

import argparse
import statistics
import time
from typing import Any, cast

BLOCK_STEPS = 8


def paired_blocks(model: Any, prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """mlx-lm's generate_step and a BatchDecoder of one, alive side by side, decoding in
    alternating blocks of BLOCK_STEPS tokens (each block ends synchronised): a shared machine's
    load then touches both alike. A block's first step (refilling the pipeline) is not timed."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, generation_stream

    from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest
    from ring_worker.engine.engines import Engine

    steps = generate_step(
        mx.array(prompt), model, max_tokens=args.max_tokens, prefill_step_size=args.chunk_tokens
    )
    engine = Engine(model)
    decoder = BatchDecoder(engine, max_batch=1)
    decoder.add(DecodeRequest("one", args.max_tokens), engine.prefill(prompt, args.chunk_tokens))
    seconds: dict[str, list[float]] = {"mlx_lm": [], "batch_of_1": []}
    tokens: dict[str, list[int]] = {"mlx_lm": [], "batch_of_1": []}
    ours: list[Any] = []

    def mlx_lm_step() -> bool:
        tokens["mlx_lm"].append(cast(int, next(steps)[0]))  # typed as an array, yields an int
        return len(tokens["mlx_lm"]) < args.max_tokens

    def our_step() -> bool:
        ours.extend(decoder.step())
        return decoder.busy

    going = {"mlx_lm": True, "batch_of_1": True}
    while any(going.values()):
        for name, step, stream in (
            ("mlx_lm", mlx_lm_step, generation_stream),
            ("batch_of_1", our_step, mx.default_stream(mx.default_device())),
        ):
            for index in range(BLOCK_STEPS):
                if not going[name]:
                    break
                started = time.perf_counter()
                going[name] = step()
                if index:
                    seconds[name].append(time.perf_counter() - started)
            mx.synchronize(stream)
    tokens["batch_of_1"] = ours[0].tokens
    tps = {name: len(s) / sum(s) for name, s in seconds.items()}
    return {
        "decode_tps": tps,
        "batch_of_1_vs_mlx_lm": tps["batch_of_1"] / tps["mlx_lm"],
        "median_step_ms": {name: 1e3 * statistics.median(s) for name, s in seconds.items()},
        "same_tokens": tokens["mlx_lm"] == tokens["batch_of_1"],
    }


def paired_batch_blocks(
    model: Any, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """mlx-lm's BatchGenerator and a BatchDecoder holding the same prefilled prompts, alive side
    by side, decode steps in alternating blocks of BLOCK_STEPS (each block ends synchronised, its
    first step untimed): decode tok/s of both under the same load."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest
    from ring_worker.engine.engines import Engine

    count = len(prompts)
    generator = BatchGenerator(
        model, completion_batch_size=count, prefill_step_size=args.chunk_tokens
    )
    uids = generator.insert(prompts, [args.max_tokens] * count)
    theirs: dict[int, list[int]] = {uid: [] for uid in uids}
    while True:  # batched prefill, until every sequence decodes
        _, generated = generator.next()
        for response in generated:
            theirs[response.uid].append(response.token)
        if len(generated) == count:
            break
    engine = Engine(model)
    decoder = BatchDecoder(engine, max_batch=count)
    for index, prompt in enumerate(prompts):
        decoder.add(
            DecodeRequest(str(index), args.max_tokens), engine.prefill(prompt, args.chunk_tokens)
        )
    ours: dict[str, list[int]] = {}
    seconds: dict[str, list[float]] = {"mlx_lm": [], "batched": []}

    def mlx_lm_step() -> bool:
        generated = generator.next_generated()
        for response in generated:
            theirs[response.uid].append(response.token)
        return bool(generated) and any(r.finish_reason is None for r in generated)

    def our_step() -> bool:
        ours.update({r.key: r.tokens for r in decoder.step()})
        return decoder.busy

    going = {"mlx_lm": True, "batched": True}
    while any(going.values()):
        for name, step, stream in (
            ("mlx_lm", mlx_lm_step, generator.stream),
            ("batched", our_step, mx.default_stream(mx.default_device())),
        ):
            for index in range(BLOCK_STEPS):
                if not going[name]:
                    break
                started = time.perf_counter()
                going[name] = step()
                if index:
                    seconds[name].append(time.perf_counter() - started)
            mx.synchronize(stream)
    generator.close()
    tps = {name: count * len(s) / sum(s) for name, s in seconds.items()}
    same = sum(theirs[uid] == ours[str(i)] for i, uid in enumerate(uids))
    return {
        "decode_tps": tps,
        "batched_vs_mlx_lm": tps["batched"] / tps["mlx_lm"],
        "median_step_ms": {name: 1e3 * statistics.median(s) for name, s in seconds.items()},
        "same_tokens": same,
    }
