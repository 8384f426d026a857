"""Options shared by the commands: a job's (`submit`, `run`), a group layout's (`run`, `bench`),
and turning them into a JobSpec."""

from collections.abc import Callable, Sequence
from typing import Any, Literal

import click
from click.core import ParameterSource

from admission.vocabulary import EXCHANGES, KV_LAYOUTS, STRATEGIES
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


def comma_list(parse: Callable[[str], object]):
    """A click callback parsing a comma-separated value, its error as click's."""

    def callback(ctx: click.Context, param: click.Parameter, value: str):
        try:
            return parse(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None

    return callback


def choices_list(choices: Sequence[str]):
    def parse(text: str) -> list[str]:
        from cli.bench_report import parse_choices  # rich, for bench's tables: bench only

        return parse_choices(text, choices)

    return comma_list(parse)


def layout_options(many: bool, strategies: Sequence[str] = STRATEGIES):
    """--strategy, --ranks, --exchange and --kv-layout, with their old names hidden: one layout
    (`run`), or comma-separated lists of them, every combination a cell (`bench`, whose
    `strategies` add mlx-lm's own)."""
    if many:
        strategy = dict(default="single,ring", callback=choices_list(strategies))
        exchange = dict(default="rotate", callback=choices_list(EXCHANGES))
        kv_layout = dict(default="replicated", callback=choices_list(KV_LAYOUTS))
        ranks = click.IntRange(2, 64)
        names = ("strategies", "exchanges", "kv_layouts")
        helps = (
            "Strategies, comma-separated: " + ", ".join(strategies) + ".",
            "Ranks of ring and pipeline cells (single always runs on one).",
            "Ring K/V exchanges, comma-separated: " + ", ".join(EXCHANGES) + ".",
            "Ring KV layouts, comma-separated: " + ", ".join(KV_LAYOUTS) + ".",
        )
    else:
        strategy = dict(default="ring", type=click.Choice(STRATEGIES))
        exchange = dict(default=None, type=click.Choice(["auto", *EXCHANGES]))
        kv_layout = dict(default=None, type=click.Choice(KV_LAYOUTS))
        ranks = click.IntRange(1, 16)
        names = ("strategy", "exchange", "kv_layout")
        helps = (
            "ring: sequence parallel; pipeline: layers split over ranks; single: one rank.",
            "Ranks of a ring or pipeline.",
            "How ring ranks share K/V blocks (default RINGQ_EXCHANGE: auto = allgather over "
            "NCCL when every rank has a GPU of its own, rotate elsewhere).",
            "KV layout on the ring's ranks (default RINGQ_KV_LAYOUT; its auto is replicated "
            "here: `ringq run` reserves no memory to choose by).",
        )
    show: dict[str, Any] = dict(show_default=True) if many else {}
    alias = {k: v for k, v in strategy.items() if k != "default"}
    layout_alias = {k: v for k, v in kv_layout.items() if k != "default"}
    options = [
        click.option("--strategy", names[0], show_default=True, help=helps[0], **strategy),
        renamed_option("--sharding", "--strategy", names[0], **alias),
        click.option("--ranks", type=ranks, default=2, show_default=True, help=helps[1]),
        renamed_option("--ring-size", "--ranks", "ranks", type=ranks),
        click.option("--exchange", names[1], help=helps[2], **show, **exchange),
        click.option("--kv-layout", names[2], help=helps[3], **show, **kv_layout),
        renamed_option("--decode-kv", "--kv-layout", names[2], **layout_alias),
    ]

    def decorate(func):
        for option in reversed(options):
            func = option(func)
        return func

    return decorate
