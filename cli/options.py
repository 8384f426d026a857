"""Job options shared by `submit` and `run`, and turning them into a JobSpec."""

from typing import Literal

import click

from cli.common import read_document
from jobs.schemas import DEFAULT_GENERATE_PROMPT, JobKind, JobSpec
from jobs.settings import get_settings


def job_options(func):
    """Options shared by `submit` and `run`."""
    return _job_options(func, click.option(
        "--prompt", default=None,
        help="Question or instruction (generate jobs). Without it a generate job summarises "
        f"the document: “{DEFAULT_GENERATE_PROMPT}”",
    ))  # fmt: skip


def submit_job_options(func):
    """`submit`'s: job_options, with --prompt repeatable (one job per question)."""
    return _job_options(func, click.option(
        "--prompt", "prompts", multiple=True,
        help="Question or instruction (generate jobs); repeat it for several questions on the "
        "same document: one job each, and the document is prefilled once (the later jobs "
        "wait for the first one's prefill and start from its kept KV). Without it a generate "
        f"job summarises the document: “{DEFAULT_GENERATE_PROMPT}”",
    ))  # fmt: skip


def _job_options(func, prompt_option):
    options = [
        click.option(
            "--model", default=None, help="Model name (smollm2), GGUF file or HF/MLX dir."
        ),
        prompt_option,
        click.option(
            "--max-tokens", type=int, default=256, show_default=True, help="Tokens to generate."
        ),
        click.option(
            "--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."
        ),
        click.option(
            "--stop",
            multiple=True,
            metavar="TEXT",
            help="Generation ends where TEXT appears (not included); up to 4, repeat the option.",
        ),
        click.option(
            "--seed", type=click.IntRange(0), default=None, help="Sampling seed (temperature > 0)."
        ),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def build_spec(
    kind: str,
    file: str,
    *,
    model,
    prompt,
    max_tokens,
    temperature,
    ring_size,
    sharding="auto",
    keep_cache=False,
    cache_from=None,
    stop=(),
    seed=None,
) -> JobSpec:
    settings = get_settings()
    text, name = read_document(file, settings.max_document_bytes)
    return JobSpec(
        kind=JobKind(kind),
        document=text,
        document_name=name,
        model=model or settings.default_model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        ring_size=parse_ring_size(ring_size),
        sharding=sharding,
        keep_cache=keep_cache,
        cache_from=cache_from,
        stop=list(stop),
        seed=seed,
    )


def parse_ring_size(value: str | int) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a number or 'auto'", param_hint="--ring-size"
        ) from None


chunk_tokens_option = click.option(
    "--chunk-tokens",
    type=click.IntRange(1),
    default=None,
    help="Prefill chunk (default RINGQ_PREFILL_CHUNK_TOKENS, else 512 on CPU and 16384 on GPUs).",
)
