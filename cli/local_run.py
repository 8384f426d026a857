"""`ringq run`: the same engine on local rank processes, no Redis."""

import threading
from typing import Literal, cast

import click
from rich.console import Console

from admission.vocabulary import Exchange, KVLayout
from cli.common import echo_json, interrupt_on_sigterm
from cli.options import build_spec, chunk_tokens_option, job_options, layout_options
from cli.render import live_progress, print_result
from jobs.errors import RingqError
from jobs.lifecycle import JobState
from jobs.prompts import tokenize_and_check
from jobs.schemas import Progress
from jobs.settings import get_settings
from jobs.submit import new_job_id
from ring_worker.runtime.local_group import LocalRunError, run_local


@click.command()
@click.argument("kind", type=click.Choice(["prefill", "generate"]))
@click.argument("file")
@job_options
@layout_options(many=False)
@chunk_tokens_option
def run(
    kind,
    file,
    model,
    prompt,
    max_tokens,
    temperature,
    stop,
    seed,
    as_json,
    strategy,
    ranks,
    chunk_tokens,
    exchange,
    kv_layout,
):
    """Run a job on this machine with local rank processes (no Redis): quick use and benchmarks."""
    interrupt_on_sigterm()
    settings = get_settings()
    size = 1 if strategy == "single" else ranks
    spec = build_spec(
        kind,
        file,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        ranks=size,
        strategy=strategy,
        stop=stop,
        seed=seed,
    )
    tokens, _ = tokenize_and_check(spec, allowed_dirs=settings.allowed_dirs)
    job_id = new_job_id()
    console = Console(stderr=True)
    outcome = run_with_progress(
        lambda on_progress, stop: run_local(
            job_id,
            spec,
            tokens,
            size,
            chunk_tokens or settings.prefill_chunk_tokens,
            scratch_root=settings.home / "runs",
            strategy=strategy,
            blas=settings.blas,
            backend=settings.backend,
            exchange=forced_exchange(exchange or settings.exchange),
            kv_layout=run_kv_layout(kv_layout, settings.kv_layout),
            on_progress=on_progress,
            stop=stop,
        ),
        Progress(phase=JobState.LOADING, total=len(tokens)),
        console if not as_json and console.is_terminal else None,
    )
    if isinstance(outcome, LocalRunError):
        raise RingqError(str(outcome))
    payload = {
        "id": job_id,
        "state": "finished",
        "error": None,
        "strategy": strategy,
        "ranks": size,
        **outcome.model_dump(mode="json"),
    }
    if as_json:
        echo_json(payload)
    else:
        print_result(Console(), payload)


def forced_exchange(choice: str) -> Exchange | None:
    return None if choice == "auto" else cast(Exchange, choice)


def run_kv_layout(flag: KVLayout | None, setting: Literal["auto", KVLayout]) -> KVLayout:
    """--kv-layout, else RINGQ_KV_LAYOUT, whose "auto" (replicated where it fits) is replicated:
    without admission nothing says it would not fit."""
    if flag is not None:
        return flag
    return "replicated" if setting == "auto" else setting


def run_with_progress(work, first: Progress, console: Console | None):
    """Run work(on_progress, stop) in a thread while the main thread draws its progress (if a
    console). Ctrl-C / SIGTERM set `stop`, and the work stops its ranks before this re-raises."""
    latest = [first]
    outcome: list = []
    stop, done = threading.Event(), threading.Event()

    def target() -> None:
        try:
            outcome.append(work(lambda p: latest.__setitem__(0, p), stop))
        except LocalRunError as exc:
            outcome.append(exc)
        finally:
            done.set()

    threading.Thread(target=target, daemon=True).start()
    try:
        if console is not None:
            live_progress(lambda: (latest[0], done.is_set()), console)
        while not done.wait(0.2):
            pass
    except KeyboardInterrupt:
        # Not Thread.join: after a join interrupted by a signal, the next join can return at once
        # (the thread looks finished), and the ranks would outlive this process.
        stop.set()
        done.wait(timeout=30)
        raise
    return outcome[0]
