"""A job's reports from its rank: the progress callback the engine calls (a watchdog kick, then
rank 0's throttled write) and the result it ends with."""

import logging
import time
from dataclasses import dataclass

from jobs.lifecycle import JobState
from jobs.schemas import JobKind, JobResult, JobSpec, Progress
from jobs.tokenizer import ChatTokenizer
from ring_worker.engine.decode_text import cut_at_stop
from ring_worker.engine.engines import DecodeResult, PrefillResult, ProgressFn
from ring_worker.engine.eta import MIN_CHUNKS, Cost, PrefillPace
from ring_worker.runtime.job_io import JobIO
from ring_worker.runtime.watchdog import Watchdog

PROGRESS_INTERVAL_S = 0.25

log = logging.getLogger(__name__)


def job_result(
    spec: JobSpec,
    tokenizer: ChatTokenizer,
    prompt_tokens: int,
    load_s: float,
    prefill: PrefillResult,
    decoded: DecodeResult,
    peaks: list[int],
) -> JobResult:
    generated = decoded.tokens
    text = tokenizer.decode([t for t in generated if t not in tokenizer.eos_token_ids])
    return JobResult(
        text=cut_at_stop(text, spec.stop) if spec.kind == JobKind.GENERATE else None,
        prompt_tokens=prompt_tokens,
        generated_tokens=len(generated),
        prompt_tps=prefill.prompt_tokens / prefill.seconds,  # the tokens computed
        generation_tps=len(generated) / decoded.seconds if decoded.seconds else 0.0,
        load_s=load_s,
        prefill_s=prefill.seconds,
        decode_s=decoded.seconds,
        peak_memory_bytes=peaks,
    )


def kicking(watchdog: Watchdog, report: ProgressFn) -> ProgressFn:
    """The engine's progress callback (every rank, each chunk / decode step): a watchdog kick,
    then the throttled report."""

    def on_progress(phase: str, done: int, total: int) -> None:
        watchdog.kick(phase)
        report(phase, done, total)

    return on_progress


@dataclass
class ReportClock:
    """A throttled report's state; `interval_s` may be changed while it reports (a decode
    batch paces its members: ring_worker/runtime/batch_serve.py)."""

    interval_s: float = PROGRESS_INTERVAL_S
    phase: str = ""
    phase_started_s: float = 0.0
    phase_from: int = 0  # tokens done at the phase's first report (a resumed prefill's start)
    last_write_s: float = 0.0
    pace: PrefillPace | None = None  # a prefill's chunk times, for its ETA


def throttled(io: JobIO, lead: bool, clock: ReportClock | None = None, cost: Cost | None = None):
    """Progress callback for the engine: rank 0 writes at most every `clock.interval_s`, and
    always the first and last update of a phase. With `cost`, a prefill's progress carries its
    ETA from the pace of every chunk so far (ring_worker/engine/eta.py), since a long prompt's
    later tokens cost more (each attends to all before it) and tokens per second fall."""
    clock = clock or ReportClock()

    def report(phase: str, done: int, total: int) -> None:
        if not lead:
            return
        now = time.perf_counter()
        if phase != clock.phase:
            clock.phase, clock.phase_started_s, clock.phase_from = phase, now, done
            clock.pace = PrefillPace(cost, done) if cost and phase == "prefill" else None
        if clock.pace is not None:
            clock.pace.add(done, now - clock.phase_started_s)
            if done == total and len(clock.pace.seen) > MIN_CHUNKS:  # what the ETA was fitted to
                ends = " ".join(f"{t}:{s:.2f}" for t, s in clock.pace.seen)
                log.info("job %s: prefill chunks ended (tokens:s) %s", io.job_id, ends)
        if done not in (1, total) and now - clock.last_write_s < clock.interval_s:
            return
        clock.last_write_s = now
        # the phase's first report has no rate yet (0: unknown), not done / 1e-9
        elapsed = now - clock.phase_started_s
        rate = (done - clock.phase_from) / elapsed if elapsed > 0 else 0.0
        eta_s = clock.pace.seconds_left(total) if clock.pace is not None else None
        io.progress(
            Progress(
                phase=JobState(phase),
                processed=done,
                total=total,
                prompt_tps=rate if phase == "prefill" else 0.0,
                generation_tps=rate if phase == "decode" else 0.0,
                eta_s=eta_s,
            )
        )

    return report


def enter(io: JobIO, lead: bool, watchdog: Watchdog, phase: JobState, total: int) -> None:
    watchdog.kick(phase.value)
    if lead:
        io.enter(phase, total)
