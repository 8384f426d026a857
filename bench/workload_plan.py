"""bench.workload's workload: the scales, the seeded documents and requests, and the distinct
prefill work they hold (each shared prefix once)."""

import math
import random
import sys
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import click

RESULTS = Path(__file__).parent / "results"
PREFILL_EVERY = 5  # documents 1, 6, 11, ... are plain prefill jobs
QUESTIONS = (
    "Summarise the passage above in three sentences.",
    "Who is named in the passage above, and what did each of them do?",
    "Why was the reef dangerous to ships?",
    "What materials were the towers built from, according to the passage?",
    "List the dates mentioned above in order, with what happened on each.",
    "What went wrong with the earlier towers?",
    "Explain in plain words how the last tower was built.",
    "Which sentence above surprised you most, and why?",
)


@dataclass(frozen=True)
class PeerSettings:
    """One try of mlx_lm.server: its continuous-batching and prompt-cache flags."""

    decode_concurrency: int
    prompt_concurrency: int
    prompt_cache_size: int
    prompt_cache_bytes: str | None = None  # mlx-lm's size syntax, e.g. "24GB"

    @classmethod
    def parse(cls, text: str) -> "PeerSettings":
        """'decode,prompt,cache_size[,cache_bytes]', e.g. '32,8,10' (mlx_lm.server's defaults)."""
        parts = [p.strip() for p in text.split(",")]
        if not 3 <= len(parts) <= 4:
            raise click.BadParameter(f"{text!r}: want decode,prompt,cache_size[,cache_bytes]")
        return cls(int(parts[0]), int(parts[1]), int(parts[2]), parts[3] if parts[3:] else None)

    def flags(self) -> list[str]:
        found = [
            "--decode-concurrency",
            str(self.decode_concurrency),
            "--prompt-concurrency",
            str(self.prompt_concurrency),
            "--prompt-cache-size",
            str(self.prompt_cache_size),
        ]
        return found + (
            ["--prompt-cache-bytes", self.prompt_cache_bytes] if self.prompt_cache_bytes else []
        )


@dataclass(frozen=True)
class Scale:
    model: str
    documents: int | None  # None: as many as reach min_prompt_tokens
    doc_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    peer_grid: str  # PeerSettings, ';'-separated
    min_prompt_tokens: int = 0


SCALES = {
    "tiny": Scale("smollm2", 3, (40, 160), (4, 4), "4,2,10"),  # the test's
    # mlx_lm.server's defaults, then prompts prefilled one at a time (its batched prefill pads
    # every prompt to the longest)
    "cpu": Scale("smollm2", 6, (600, 6000), (32, 32), "32,8,10;8,1,10"),
    "gpu": Scale(
        "random:llama-3.1-8b",
        None,
        (4096, 130_000),  # 128K context less the template, a question and 256 answer tokens
        (32, 256),
        # not its defaults: 32 rows and 8 prompts prefilled together, at up to 17 GB of KV a
        # 128K-token prompt, do not fit beside 16 GB of weights on an 80 GB card (8 and 4
        # rows ran out of memory there); a cache of 20 GB holds one such document's KV
        "2,1,4,20GB;1,1,4,20GB",
        min_prompt_tokens=1_000_000,
    ),
}


@dataclass(frozen=True)
class Request:
    custom_id: str
    document: int
    kind: str  # "generate" | "prefill"
    text: str  # a question's one user message (document, then question), or a prefill's document
    max_tokens: int  # a prefill's: 1 (the peer's one-token completion)

    def batch_line(self, model: str) -> dict[str, Any]:
        if self.kind == "prefill":
            return {
                "custom_id": self.custom_id,
                "kind": "prefill",
                "document": self.text,
                "model": model,
            }
        body = {
            "model": model,
            "messages": [{"role": "user", "content": self.text}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        return {
            "custom_id": self.custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": body,
        }


def make_workload(scale: Scale, tokenizer: Any, seed: int) -> list[Request]:
    """The seeded requests, documents in order, each document's questions together."""
    rng = random.Random(seed)
    ids = tokenizer.encode(
        files("cli").joinpath("demo/document.md").read_text(), add_special_tokens=False
    )
    low, high = scale.doc_tokens
    requests: list[Request] = []
    prompt_tokens = index = 0
    while index < (scale.documents or sys.maxsize) and (
        scale.documents or prompt_tokens < scale.min_prompt_tokens
    ):
        length = round(math.exp(rng.uniform(math.log(low), math.log(high))))
        start = rng.randrange(len(ids))
        tiled = ids * (2 + (start + length) // len(ids))
        document = f"Document {index}.\n" + tokenizer.decode(tiled[start : start + length]).strip()
        if index % PREFILL_EVERY == 1:
            requests.append(Request(f"doc{index}-prefill", index, "prefill", document, 1))
            prompt_tokens += length
        else:
            for number, question in enumerate(rng.sample(QUESTIONS, rng.randint(1, 4))):
                answer = rng.randint(*scale.output_tokens)
                text = f"{document}\n\n{question}"
                requests.append(Request(f"doc{index}-q{number}", index, "generate", text, answer))
                prompt_tokens += length
        index += 1
    return requests


def prompt_tokens_of(requests: list[Request], model: str) -> dict[str, list[int]]:
    """Each request's prompt as ringq tokenizes it (jobs.prompts: the chat template over the one
    user message; a prefill's document as it is)."""
    from jobs.model_catalog import resolve_model
    from jobs.prompts import prompt_tokens
    from jobs.schemas import JobKind, JobSpec

    source = resolve_model(model, allowed_dirs=None)
    found = {}
    for request in requests:
        kind = JobKind.PREFILL if request.kind == "prefill" else JobKind.GENERATE
        spec = JobSpec(kind=kind, document=request.text, prompt="", model=model)
        found[request.custom_id] = prompt_tokens(spec, source)
    return found


def shared_prefix(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with (0 for one prompt), leaving each at least one of its own."""
    if len(prompts) < 2:
        return 0
    common = 0
    for column in zip(*prompts, strict=False):
        if any(token != column[0] for token in column):
            break
        common += 1
    return min(common, min(map(len, prompts)) - 1)


def prefill_ranges(requests: list[Request], tokens: dict[str, list[int]]) -> list[tuple[int, int]]:
    """The distinct prefill work: per document its shared prefix [0, P) once, then each request's
    rest [P, N)."""
    ranges = []
    for document in sorted({r.document for r in requests}):
        mine = [tokens[r.custom_id] for r in requests if r.document == document]
        common = shared_prefix(mine)
        ranges += [(0, common)] if common else []
        ranges += [(common, len(prompt)) for prompt in mine]
    return ranges
