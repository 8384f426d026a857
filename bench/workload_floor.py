"""bench.workload's floor: ringq's own engine doing the batch's distinct work in this process on
one device. Each document's shared prefix is prefilled once and each request's rest after it
(the prefix's KV trimmed back between them, so nothing is copied); every question joins one
BatchDecoder at ringq's default batch limit (DEFAULT_MAX_BATCH), stepping only when a row must
leave to make room. Seconds = prefill seconds + decode seconds (joins and steps), run one after
the other as one group does; loading and warm-up are not counted. Run by
bench.workload_sides.engine_floor in a process of its own (`main`)."""

import json
import sys
import time
from pathlib import Path
from typing import Any

from admission.vocabulary import Device
from bench.workload_plan import Request, shared_prefix

HEADROOM_BYTES = 4 * 1024**3  # beside the weights and KV: a prefill chunk's activations


def main(work: str, out: str) -> None:
    """The floor of `work` (JSON: requests, tokens, model) written to `out` as JSON."""
    given = json.loads(Path(work).read_text())
    requests = [Request(**row) for row in given["requests"]]
    Path(out).write_text(json.dumps(floor(requests, given["tokens"], given["model"])))


def floor(requests: list[Request], tokens: dict[str, list[int]], model: str) -> dict[str, Any]:
    import mlx.core as mx
    import psutil

    from admission.group_plan import default_chunk_tokens
    from jobs.model_catalog import resolve_model
    from jobs.settings import get_settings, max_batch_for
    from jobs.tokenizer import load_tokenizer
    from ring_worker.engine.batch_decode import BatchDecoder, warm_up
    from ring_worker.engine.devices import cap_device_memory
    from ring_worker.engine.engines import Engine
    from ring_worker.engine.models import load_for_this_device

    backend: Device = (
        "cuda" if mx.cuda.is_available() else "metal" if mx.metal.is_available() else "cpu"
    )
    settings = get_settings()
    chunk = settings.prefill_chunk_tokens or default_chunk_tokens(backend)
    max_batch = max_batch_for(settings, backend)
    limit = cap_device_memory() or psutil.virtual_memory().available
    source = resolve_model(model, allowed_dirs=None)
    engine = Engine(load_for_this_device(source))
    if backend != "cpu":  # kernels compiled before timing, as a warm GPU group has them
        engine.prefill([1] * 1024, 512)
        warm_up(engine, max_batch)
        print(f"floor: warmed up, limit {limit / 1e9:.1f} GB, {mx.get_active_memory() / 1e9:.1f} "
              f"GB active", file=sys.stderr, flush=True)  # fmt: skip
    run = _Run(engine, BatchDecoder(engine, max_batch=max_batch), max_batch, load_tokenizer(source))
    run.limit_bytes = limit
    for document in sorted({r.document for r in requests}):
        run.document([r for r in requests if r.document == document], tokens, chunk)
        print(
            f"floor: document {document} done at {run.prefill_s:.1f} s of prefill, "
            f"{mx.get_active_memory() / 1e9:.1f} GB active, {mx.get_peak_memory() / 1e9:.1f} GB "
            f"peak, {len(run.held)} rows",
            file=sys.stderr,
            flush=True,
        )
    run.drain()
    return {
        "seconds": run.prefill_s + run.decode_s,
        "prefill_s": run.prefill_s,
        "decode_s": run.decode_s,
        "decode_steps": run.steps,
        "prefill_tokens": run.prefill_tokens,
        "chunk_tokens": chunk,
        "max_batch": max_batch,
        "memory_limit_bytes": run.limit_bytes,
        "backend": backend,
        "texts": run.texts,
    }


def kv_bytes_per_token(cache: list[Any]) -> int:
    """A prefill cache's KV bytes per position, over all its layers."""
    layer = cache[0]
    return len(cache) * (layer.keys.nbytes + layer.values.nbytes) // layer.keys.shape[2]


def join_bytes(slots: int, rows: list[int], kv_bytes_per_token: int) -> int:
    """The new buffers a batch of `slots` slots builds when a join leaves it holding `rows`
    (each row's positions): slots doubled as needed, each as long as the longest row (rows are
    aligned at their ends)."""
    from ring_worker.engine.batch_cache import grown_slots

    return grown_slots(slots, len(rows)) * max(rows) * kv_bytes_per_token


class _Run:
    def __init__(self, engine: Any, decoder: Any, max_batch: int, tokenizer: Any):
        self.engine, self.decoder, self.max_batch = engine, decoder, max_batch
        self.tokenizer, self.eos = tokenizer, tokenizer.eos_token_ids
        self.held: dict[str, int] = {}  # each row's positions at its end
        self.texts: dict[str, str] = {}
        self.prefill_s = self.decode_s = 0.0
        self.steps = self.prefill_tokens = 0
        self.limit_bytes = 0
        self.kv_bytes_per_token = 0

    def document(self, mine: list[Request], tokens: dict[str, list[int]], chunk: int) -> None:
        from ring_worker.engine.batch_decode import DecodeRequest

        prompts = [tokens[r.custom_id] for r in mine]
        common = shared_prefix(prompts)
        cache = self._prefill(prompts[0][:common], chunk, None).cache if common else None
        for request, prompt in zip(mine, prompts, strict=True):
            result = self._prefill(prompt[common:], chunk, cache)
            if request.kind == "generate":
                began = time.perf_counter()
                positions = len(prompt) + request.max_tokens
                while self.decoder.busy and not self._fits(positions):
                    self._step()
                asked = DecodeRequest(request.custom_id, request.max_tokens, stop_ids=self.eos)
                self.decoder.add(asked, result)
                self.held[request.custom_id] = positions
                self.decode_s += time.perf_counter() - began
            if cache is not None:
                for layer in cache:
                    layer.trim(len(prompt) - common)
            del result

    def drain(self) -> None:
        began = time.perf_counter()
        while self.decoder.busy:
            self._step()
        self.decode_s += time.perf_counter() - began

    def _prefill(self, prompt: list[int], chunk: int, cache: Any) -> Any:
        result = self.engine.prefill(prompt, chunk, cache=cache)
        self.prefill_s += result.seconds
        self.prefill_tokens += len(prompt)
        self.kv_bytes_per_token = self.kv_bytes_per_token or kv_bytes_per_token(result.cache)
        return result

    def _fits(self, positions: int) -> bool:
        """Whether a row of `positions` joins without running out of memory. Rows are aligned
        at their ends, so each holds as many positions as the longest; a join builds the
        batch's new buffers (slots doubled as needed) while everything now in use (weights,
        the batch's old buffers, the document's prefill cache kept for its next question)
        still lives. What is in use is measured, with MLX's cache of freed buffers returned."""
        import mlx.core as mx

        rows = [positions, *self.held.values()]
        after = join_bytes(self.decoder.cache.slots, rows, self.kv_bytes_per_token)
        # CUDA frees asynchronously: wait, so the buffers freed so far are back before measuring
        # (a pool still holding them can fail a large allocation that the numbers say fits)
        mx.synchronize()
        mx.clear_cache()
        needed = mx.get_active_memory() + after + HEADROOM_BYTES
        return len(rows) <= self.max_batch and needed <= self.limit_bytes

    def _step(self) -> None:
        for result in self.decoder.step():
            self.held.pop(result.key)
            generated = [t for t in result.tokens if t not in self.eos]
            self.texts[result.key] = self.tokenizer.decode(generated)
        self.steps += 1
