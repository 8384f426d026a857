"""bench.workload's JSON: the workload, the three sides, the ratios of their makespans, MFU,
and the sides' prompt token counts and greedy answers compared."""

import statistics
from typing import Any

from bench.workload_plan import Request, prefill_ranges


def build_report(
    context: dict[str, Any],
    requests: list[Request],
    tokens: dict[str, list[int]],
    sides: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The JSON: the workload, the sides (ringq, mlx_lm_server, engine_floor), ratios of their
    makespans, MFU, and the two sides' prompt token counts and greedy answers compared."""
    ringq, peer, floor = sides["ringq"], sides["mlx_lm_server"], sides["engine_floor"]
    best = peer.get("best") or {}
    seconds = {
        "ringq": ringq.get("makespan_s"),
        "mlx_lm_server": best.get("makespan_s"),
        "engine_floor": floor.get("seconds"),
    }
    for side in (ringq, best):
        finished = [r["finished_s"] for r in side.get("requests", {}).values() if r["finished_s"]]
        side["latency_s"] = summarise(finished)
    ranges = prefill_ranges(requests, tokens)
    return {
        **context,
        "prompt_tokens": sum(map(len, tokens.values())),
        "distinct_prompt_tokens": sum(end - start for start, end in ranges),
        "workload": [
            {
                "custom_id": r.custom_id,
                "kind": r.kind,
                "document": r.document,
                "max_tokens": r.max_tokens,
                "prompt_tokens": len(tokens[r.custom_id]),
            }
            for r in requests
        ],
        **sides,
        "engine_floor_s": seconds["engine_floor"],
        "ratio": {
            "ringq_over_peer": ratio(seconds["ringq"], seconds["mlx_lm_server"]),
            "ringq_over_floor": ratio(seconds["ringq"], seconds["engine_floor"]),
            "peer_over_floor": ratio(seconds["mlx_lm_server"], seconds["engine_floor"]),
        },
        "mfu": mfu_of(context, requests, tokens, seconds),
        **agreement(requests, tokens, ringq, best, floor),
    }


def ratio(top: float | None, bottom: float | None) -> float | None:
    return top / bottom if top and bottom else None


def mfu_of(
    context: dict[str, Any],
    requests: list[Request],
    tokens: dict[str, list[int]],
    seconds: dict[str, float | None],
) -> dict[str, Any]:
    """Prompt FLOPs of the distinct work over each side's seconds x the peak (decode left out)."""
    from jobs.model_catalog import read_model_shape, resolve_model

    shape = read_model_shape(resolve_model(context["model"], allowed_dirs=None))
    distinct = sum(prefill_flops(shape, a, b) for a, b in prefill_ranges(requests, tokens))
    peak_tflops = context["peak"]["tflops"]
    found: dict[str, Any] = {
        "prompt_flops": distinct,
        "prompt_flops_every_prompt_whole": sum(
            prefill_flops(shape, 0, len(t)) for t in tokens.values()
        ),
        "peak_tflops": peak_tflops,
        "peak_source": context["peak"]["source"],
    }
    for side, spent in seconds.items():
        found[side] = distinct / (spent * peak_tflops * 1e12) if spent and peak_tflops else None
    return found


def agreement(
    requests: list[Request],
    tokens: dict[str, list[int]],
    ringq: dict[str, Any],
    peer: dict[str, Any],
    floor: dict[str, Any],
) -> dict[str, Any]:
    """Prompt token counts (ringq's usage against the peer's and this process's tokenizer) and
    greedy answers (ringq's against the peer's best try and the floor's engine)."""
    ids = [r.custom_id for r in requests if r.kind == "generate"]
    ringq_rows, peer_rows = ringq.get("requests", {}), peer.get("requests", {})
    ringq_tokens = {i: row["prompt_tokens"] for i, row in ringq_rows.items()}
    ringq_texts = {i: row["text"] for i, row in ringq_rows.items()}
    return {
        "prompt_token_mismatches": {
            "ringq_vs_mlx_lm_server": mismatches(
                ringq_tokens, {i: row.get("prompt_tokens") for i, row in peer_rows.items()}
            ),
            "ringq_vs_local_tokenizer": mismatches(
                ringq_tokens, {i: len(t) for i, t in tokens.items()}
            ),
        },
        "identical_texts": {
            "ringq_vs_mlx_lm_server": compare_texts(
                ringq_texts, {i: row.get("text") for i, row in peer_rows.items()}, ids
            ),
            "ringq_vs_engine_floor": compare_texts(ringq_texts, floor.get("texts", {}), ids),
        },
    }


def compare_texts(one: dict[str, Any], other: dict[str, Any], ids: list[str]) -> dict[str, Any]:
    """Greedy answers of two sides, by custom_id (generate requests both answered)."""
    pairs = [i for i in ids if one.get(i) is not None and other.get(i) is not None]
    differ = [i for i in pairs if one[i] != other[i]]
    return {"identical": len(pairs) - len(differ), "compared": len(pairs), "differ": differ}


def mismatches(ringq: dict[str, Any], other: dict[str, Any]) -> list[dict[str, Any]]:
    """Requests whose prompt token counts differ (or that one side did not count)."""
    return [
        {"custom_id": i, "ringq": n, "other": other.get(i)}
        for i, n in ringq.items()
        if other.get(i) != n
    ]


def peak(peak_tflops: float | None) -> dict[str, Any]:
    if peak_tflops:
        return {"tflops": peak_tflops, "source": "--peak-tflops"}
    from cli.bench_machine import probe_matmul_tflops

    probe = probe_matmul_tflops("auto")
    return {"tflops": probe["tflops"] if probe else None, "source": "matmul probe", "probe": probe}


def prefill_flops(shape: Any, start: int, end: int) -> float:
    """ModelShape.prefill_flops where it exists; else the same formula: 2 P_non-embedding per
    token plus 4 layers d_model n per token at position n."""
    if hasattr(shape, "prefill_flops"):
        return float(shape.prefill_flops(start, end))
    linear = 2.0 * shape.non_embedding_parameters * (end - start)
    return linear + 2.0 * shape.layers * shape.hidden_size * (end**2 - start**2)


def summarise(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {
        "p50": statistics.median(ordered),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "max": ordered[-1],
    }
