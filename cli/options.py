"""Job options shared by `submit` and `run`, and turning them into a JobSpec."""

from typing import Literal

import click
from click.core import ParameterSource

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
    ranks,
    strategy="auto",
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
        ranks=parse_ranks(ranks),
        strategy=strategy,
        keep_cache=keep_cache,
        cache_from=cache_from,
        stop=list(stop),
        seed=seed,
    )


def parse_ranks(value: str | int) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a number or 'auto'", param_hint="--ranks"
        ) from None


def renamed_option(old: str, new: str, dest: str, callback=None, **kwargs):
    """The flag `new` had before: hidden, it sets `new`'s parameter `dest`, with a one-line note
    on stderr. Give it `new`'s type and callback, not its default."""

    def given(ctx: click.Context, param: click.Parameter, value) -> None:
        source = ctx.get_parameter_source(param.name) if param.name else None
        if source is not ParameterSource.COMMANDLINE:
            return  # not given: `new`'s value (its default) stands
        click.echo(f"{old} is deprecated, use {new}", err=True)
        # Processed before `new` when `new` is not given, and click keeps a value set so.
        ctx.params[dest] = callback(ctx, param, value) if callback else value

    return click.option(old, hidden=True, expose_value=False, callback=given, **kwargs)


chunk_tokens_option = click.option(
    "--chunk-tokens",
    type=click.IntRange(1),
    default=None,
    help="Prefill chunk (default RINGQ_PREFILL_CHUNK_TOKENS, else 512 on CPU and 16384 on GPUs).",
)
