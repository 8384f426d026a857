"""Generate jobs that start from a kept KV cache vs the same jobs without it, alternated in one
run on a local cluster: one prefill job keeps the document's cache, then each question is asked
both ways.

    uv run python -m bench.kept_cache --model smollm2 --questions 4

Writes bench/results/kept-cache.json.
"""

import json
import statistics
import sys
import time
from importlib.resources import files
from pathlib import Path

import click

from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import private_cluster

OUT = Path(__file__).parent / "results" / "kept-cache.json"
QUESTIONS = [
    "What is the main idea of the document?",
    "Name one number the document gives.",
    "Who would use this, in one sentence?",
    "What is the document's title?",
    "List two terms the document defines.",
    "What does the document say about memory?",
]


def run(store: JobStore, spec: JobSpec) -> JobRecord:
    record = submit_job(store.conn, spec)
    while not (final := store.get(record.id)).state.is_final:
        time.sleep(0.01)
    assert final.state == JobState.FINISHED, final.error
    return final


@click.command()
@click.option("--model", default="smollm2", show_default=True)
@click.option("--questions", default=4, show_default=True)
@click.option("--max-tokens", default=8, show_default=True)
def main(model: str, questions: int, max_tokens: int) -> None:
    document = files("cli").joinpath("demo/document.md").read_text()
    rows: list[dict] = []
    with private_cluster("kept", {"RINGQ_RANK_PORT_BASE": "37300"}) as cluster:
        store = JobStore(connect(cluster.url))
        kept = run(
            store, JobSpec(kind=JobKind.PREFILL, document=document, model=model, keep_cache=True)
        )
        assert kept.result is not None
        for question in QUESTIONS[:questions]:
            spec = JobSpec(
                kind=JobKind.GENERATE,
                document=document,
                prompt=question,
                model=model,
                max_tokens=max_tokens,
                strategy="single",
            )
            for cache_from in (kept.id, None):
                final = run(store, spec.model_copy(update={"cache_from": cache_from}))
                assert final.result is not None
                rows.append(
                    {
                        "question": question,
                        "cache": cache_from is not None,
                        "prompt_tokens": final.result.prompt_tokens,
                        "cached_tokens": final.result.cached_tokens,
                        "prefill_s": final.result.prefill_s,
                        "end_to_end_s": final.updated_at - final.created_at,
                        "text": final.result.text,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)

    def median(cache: bool, key: str) -> float:
        return float(statistics.median(float(r[key]) for r in rows if r["cache"] == cache))

    same = all(
        a["text"] == b["text"] for a, b in zip(rows[::2], rows[1::2], strict=True)
    )  # greedy: the cache must not change the answer
    result: dict = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m bench.kept_cache", *sys.argv[1:]]),
        "kept_prefill_tokens": kept.result.prompt_tokens,
        "kept_prefill_s": kept.result.prefill_s,
        "median_prefill_s": {
            "cache": median(True, "prefill_s"),
            "plain": median(False, "prefill_s"),
        },
        "median_end_to_end_s": {
            "cache": median(True, "end_to_end_s"),
            "plain": median(False, "end_to_end_s"),
        },
        "same_answers": same,
        "rows": rows,
    }
    result["prefill_speedup"] = (
        result["median_prefill_s"]["plain"] / result["median_prefill_s"]["cache"]
    )
    result["end_to_end_speedup"] = (
        result["median_end_to_end_s"]["plain"] / result["median_end_to_end_s"]["cache"]
    )
    OUT.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
