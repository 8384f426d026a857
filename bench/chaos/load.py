"""The chaos soak's load: a fixed pool of job specs (prefill and generate; single, ring-2 and
pipeline-2; a tiny random model plus a few SmolLM2 jobs), drawn at random into direct
submissions and OpenAI-batch-style JSONL files, and the checks made on it at the end."""

import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import redis

from admission.vocabulary import Strategy
from jobs import keys
from jobs.batch import submit_batch
from jobs.batch_input import BatchItem, Defaults, describe_errors, parse_batch_file
from jobs.lifecycle import JobState
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import enqueue_jobs, new_job_id

TINY = "random:tiny-llama"  # byte tokenizer: one token per byte
SMOLLM2 = "smollm2"
_TEXT = "Ring attention splits a long prompt over several machines, block by block. "
DOCUMENTS_TOKENS = (150, 450, 900)
LAYOUTS: tuple[tuple[Strategy, int], ...] = (("single", 1), ("ring", 2), ("pipeline", 2))
PROMPT = "Summarise."
MAX_TOKENS = 8
SMOLLM2_SHARE = 0.02  # of the jobs: a few real-model jobs among the tiny ones
BATCH_LINES = 25
_DONE = re.compile(r"job (\S+) rank 0: done")


def document(tokens: int) -> str:
    return (_TEXT * (tokens // len(_TEXT) + 1))[:tokens]


def direct_pool(documents_tokens: tuple[int, ...] = DOCUMENTS_TOKENS) -> list[JobSpec]:
    """Specs submitted one by one, with an explicit layout."""
    specs = []
    for tokens in documents_tokens:
        for strategy, ranks in LAYOUTS:
            for kind in (JobKind.PREFILL, JobKind.GENERATE):
                specs.append(_spec(TINY, kind, document(tokens), strategy, ranks))
    return specs


def smollm2_pool() -> list[JobSpec]:
    doc = document(300)
    return [_spec(SMOLLM2, JobKind.GENERATE, doc, s, n) for s, n in LAYOUTS[:2]]


def batch_line_pool(documents_tokens: tuple[int, ...] = DOCUMENTS_TOKENS) -> list[dict]:
    """Plain batch lines (their layout is the dispatcher's choice)."""
    lines = []
    for tokens in documents_tokens:
        base = {"document": document(tokens), "model": TINY, "max_tokens": MAX_TOKENS}
        lines += [{**base, "kind": "prefill"}, {**base, "kind": "generate", "prompt": PROMPT}]
    return lines


def _spec(model: str, kind: JobKind, doc: str, strategy: Strategy, ranks: int) -> JobSpec:
    prompt = PROMPT if kind == JobKind.GENERATE else None
    return JobSpec(
        kind=kind,
        document=doc,
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        strategy=strategy,
        ranks=ranks,
    )


def spec_key(spec: JobSpec) -> str:
    """The same job, whoever submitted it: the spec without its names."""
    return spec.model_copy(update={"custom_id": None, "document_name": "-"}).model_dump_json()


@dataclass
class Load:
    direct: list[tuple[str, JobSpec]]
    batch_files: list[Path]

    @property
    def count(self) -> int:
        return len(self.direct) + sum(len(p.read_text().splitlines()) for p in self.batch_files)


def draw_load(
    count: int,
    rng: random.Random,
    out_dir: Path,
    smollm2_share: float = SMOLLM2_SHARE,
    documents_tokens: tuple[int, ...] = DOCUMENTS_TOKENS,
) -> Load:
    """`count` jobs: half submitted directly, half as batch files of BATCH_LINES lines."""
    pool, real = direct_pool(documents_tokens), smollm2_pool()
    lines = batch_line_pool(documents_tokens)
    direct_count = count - count // 2
    direct = []
    for _ in range(direct_count):
        spec = rng.choice(real) if rng.random() < smollm2_share else rng.choice(pool)
        direct.append((new_job_id(), spec))
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for start in range(0, count // 2, BATCH_LINES):
        size = min(BATCH_LINES, count // 2 - start)
        path = out_dir / f"batch-{start // BATCH_LINES:03d}.jsonl"
        chosen = [{"custom_id": f"req-{start + i}", **rng.choice(lines)} for i in range(size)]
        path.write_text("".join(json.dumps(line) + "\n" for line in chosen))
        files.append(path)
    return Load(direct, files)


def parse_batch(path: Path, settings: Settings) -> list[BatchItem]:
    defaults = Defaults(
        model=None,
        default_model=settings.default_model,
        max_tokens=MAX_TOKENS,
        max_document_bytes=settings.max_document_bytes,
    )
    parsed = parse_batch_file(path, defaults)
    if parsed.errors:
        raise ValueError(f"{path}: {describe_errors(parsed)}")
    return parsed.items


def reference_specs(load: Load, settings: Settings) -> list[JobSpec]:
    """One spec per distinct job of the load: what the fault-free reference run runs."""
    found: dict[str, JobSpec] = {}
    for _, spec in load.direct:
        found.setdefault(spec_key(spec), spec)
    for path in load.batch_files:
        for item in parse_batch(path, settings):
            found.setdefault(spec_key(item.spec), item.spec.model_copy(update={"custom_id": None}))
    return list(found.values())


def submit_load(conn: redis.Redis, load: Load, settings: Settings) -> list[str]:
    """Enqueue everything (direct jobs in one go, then every batch file): the job ids."""
    ids = [record.id for record in enqueue_jobs(conn, load.direct)]
    for path in load.batch_files:
        record = submit_batch(conn, parse_batch(path, settings), path.name)
        ids += [entry.job_id for entry in record.entries]
    return ids


def job_states(conn: redis.Redis, job_ids: list[str]) -> dict[str, JobState]:
    with conn.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(keys.job(job_id), "state")
        raw = pipe.execute()
    return {i: JobState(json.loads(s)) for i, s in zip(job_ids, raw, strict=True) if s}


def completions_by_job(home: Path) -> Counter[str]:
    """How many groups ran each job to completion (rank 0 logs `done` after writing a result)."""
    counts: Counter[str] = Counter()
    for log_path in (home / "logs").glob("*-rank0.log"):
        counts.update(_DONE.findall(log_path.read_text(errors="replace")))
    return counts


@dataclass(frozen=True)
class Verdict:
    final: int
    lost: list[str]  # never reached a final state, or finished without a result
    completed_twice: list[str]
    text_mismatches: list[str]
    without_reference: list[str]  # finished, but the reference run of their spec failed
    states: dict[str, int]
    failed_errors: list[str]


def check_jobs(
    store: JobStore, job_ids: list[str], reference: dict[str, str | None], home: Path
) -> Verdict:
    records = [store.get(job_id) for job_id in job_ids]
    runs = completions_by_job(home)
    lost = [r.id for r in records if not r.state.is_final or _finished_empty(r)]
    twice = [r.id for r in records if runs[r.id] > 1]
    compared = [
        r
        for r in records
        if r.state == JobState.FINISHED and r.result is not None and r.spec.temperature == 0
    ]
    unreferenced = [r.id for r in compared if spec_key(r.spec) not in reference]
    mismatched = [
        r.id
        for r in compared
        if spec_key(r.spec) in reference
        and r.result is not None
        and r.result.text != reference[spec_key(r.spec)]
    ]
    return Verdict(
        final=sum(r.state.is_final for r in records),
        lost=lost,
        completed_twice=twice,
        text_mismatches=mismatched,
        without_reference=unreferenced,
        states=dict(Counter(r.state.value for r in records)),
        failed_errors=[f"{r.id}: {r.error}" for r in records if r.state == JobState.FAILED],
    )


def _finished_empty(record: JobRecord) -> bool:
    return record.state == JobState.FINISHED and record.result is None
