"""Chaos soak: many jobs through `ringq up --nodes 2` while ranks, node agents, the dispatcher and
Redis are killed, stopped and restarted at random moments; then every invariant is checked.

    uv run python -m bench.chaos.soak --jobs 1000 --faults 60
    uv run python -m bench.chaos.soak --jobs 1000 --no-faults     # the throughput baseline

First a fault-free reference run of every distinct job of the load (one each), then the load:
half the jobs submitted directly, half as batch files, a few cancelled at random moments.
Invariants at the end: every job final, none lost, none completed twice, every finished greedy
job's text equal to its reference, reservations back to 0, no rank process left, and the
dispatcher's and node agents' RSS flat: for each of their processes, its largest RSS once it has
seen 10 % of the jobs end (and lived 30 s) at most 10 % above its largest RSS until then
(rss_growth: a restarted service's new process is compared with its own early samples).
Writes bench/results/chaos-<jobs>.json (or chaos-fault-free-<jobs>.json).
"""

import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import psutil
import redis

from bench.chaos.faults import (
    RECOVERY_TIMEOUT_S,
    Fault,
    Injector,
    RankProcess,
    pick_kind,
    rank_processes,
)
from bench.chaos.load import (
    DOCUMENTS_TOKENS,
    SMOLLM2_SHARE,
    Verdict,
    check_jobs,
    draw_load,
    job_states,
    reference_specs,
    spec_key,
    submit_load,
)
from jobs.cancel import cancel_job
from jobs.errors import RingqError
from jobs.lifecycle import JobState
from jobs.overview import reserved_per_node
from jobs.redis_server import SOCKET_NAME, connect, shutdown_embedded, unix_url
from jobs.schemas import JobSpec
from jobs.service_status import read_service_statuses
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import enqueue_jobs, new_job_id

log = logging.getLogger(__name__)
OUT = Path(__file__).parent / "results"
ENV = {
    "RINGQ_STALL_TIMEOUT_S": "10",
    "RINGQ_PREFILL_CHUNK_TOKENS": "64",
    "RINGQ_NODE_HEARTBEAT_S": "0.5",
    "RINGQ_NODE_TTL_S": "3",
    "RINGQ_RESERVATION_LEASE_S": "5",
    "RINGQ_GROUP_IDLE_S": "5",
    "RINGQ_MAX_RETRIES": "6",
    # A few groups per node at a time: 1,000 queued jobs would otherwise start dozens of ranks.
    "RINGQ_NODE_MEMORY_LIMIT_GIB": "1.5",
}
CANCEL_SHARE = 0.03
RESERVE_SHARE = 0.25  # of the direct jobs, held back to keep the load going until every fault is in
LOW_WATER = 4  # jobs not yet final below which a part of the reserve is submitted
TICK_S = 0.5
RSS_GROWTH_LIMIT = 1.10
# A process's first seconds are part of its early RSS, whatever the job count: a restarted
# dispatcher went 50 -> 112 MB over its first 15 s (imports, its first jobs' tokenizers) and then
# stayed flat (python -m bench.chaos.soak --jobs 20 --faults 3).
RSS_WARM_UP_S = 30.0


@dataclass
class SoakConfig:
    jobs: int
    faults: int
    seed: int = 0
    fault_gap_s: tuple[float, float] = (3.0, 15.0)  # pause between one recovery and the next fault
    smollm2_share: float = SMOLLM2_SHARE
    documents_tokens: tuple[int, ...] = DOCUMENTS_TOKENS
    fault_kinds: tuple[str, ...] = ()  # inject these kinds in turn; empty: at random, by weight
    timeout_s: float = 4 * 3600.0
    sample_s: float = 5.0


@dataclass
class Progress:
    """What the soak loop tracks while the load runs."""

    ids: list[str]
    cancel_at: dict[str, int]  # job id -> cancel once this many jobs are final
    reserve: list[tuple[str, JobSpec]] = field(default_factory=list)  # submitted by top_up
    reserve_part: int = 1
    spares: list[JobSpec] = field(default_factory=list)  # copied when the reserve runs dry early
    faults: list[Fault] = field(default_factory=list)
    open_fault: Fault | None = None
    drawn_kind: str | None = None  # the next fault's kind, kept until a fault of it is injected
    drawn_at_s: float | None = None
    next_fault_at_s: float = 0.0
    samples: list[dict] = field(default_factory=list)
    finished: int = 0
    final: int = 0


def start_up(home: Path, env_extra: dict[str, str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RINGQ_REDIS_URL"}
    env.update(ENV, RINGQ_HOME=str(home), **env_extra)
    out = (home / "up.out").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "up", "--nodes", "2"],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while "Ctrl-C stops" not in " ".join((home / "up.out").read_text().split()):
        if up.poll() is not None or time.monotonic() > deadline:
            raise RingqError(f"`ringq up` did not start: {(home / 'up.out').read_text()}")
        time.sleep(0.2)
    return up


def run_reference(conn: redis.Redis, specs: list, timeout_s: float = 600) -> dict[str, str | None]:
    """Each distinct job once, no faults: the texts the soak's jobs must reproduce."""
    records = enqueue_jobs(conn, [(new_job_id(), spec) for spec in specs])
    ids = [r.id for r in records]
    deadline = time.monotonic() + timeout_s
    while not all(s.is_final for s in job_states(conn, ids).values()):
        if time.monotonic() > deadline:
            raise RingqError("the fault-free reference run did not finish")
        time.sleep(TICK_S)
    store = JobStore(conn)
    texts = {}
    for job_id in ids:
        record = store.get(job_id)
        if record.state == JobState.FINISHED and record.result is not None:
            texts[spec_key(record.spec)] = record.result.text
        else:  # its jobs in the load are then counted as having no reference, not compared
            log.warning("reference job %s ended %s: %s", job_id, record.state, record.error)
    return texts


def soak_loop(conn, injector: Injector, config: SoakConfig, progress: Progress) -> None:
    rng = random.Random(config.seed + 1)
    started_s = time.monotonic()
    progress.next_fault_at_s = started_s + rng.uniform(*config.fault_gap_s)
    next_sample_s = started_s
    while time.monotonic() - started_s < config.timeout_s:
        try:
            states = job_states(conn, progress.ids)
        except redis.RedisError:
            time.sleep(TICK_S)
            continue
        progress.final = sum(s.is_final for s in states.values())
        progress.finished = sum(s == JobState.FINISHED for s in states.values())
        top_up(conn, config, progress)
        pending = progress.final < len(progress.ids) or bool(progress.reserve)
        cancel_due(conn, progress, states)
        step_faults(injector, config, progress, rng, pending)
        if time.monotonic() >= next_sample_s or not pending:
            progress.samples.append(sample(conn, injector.home, started_s, progress.final))
            next_sample_s += config.sample_s
        if not pending and progress.open_fault is None:
            return
        time.sleep(TICK_S)
    # Timed out: the jobs still not final are reported as lost.


def top_up(conn, config: SoakConfig, progress: Progress) -> None:
    """Submit part of the held-back reserve when the load runs low while faults are still to come
    (so that every fault hits a running load), and all of it once every fault is in."""
    faults_left = len(progress.faults) < config.faults or progress.open_fault is not None
    if faults_left and len(progress.ids) - progress.final >= LOW_WATER:
        return
    if not progress.reserve:
        if not faults_left or not progress.spares:
            return
        # Dry with faults to come (the jobs ended faster than the faults recovered: once, a
        # 20-job soak ended after 3 of its 4): a copy of a held-back job keeps a load to hit.
        spec = progress.spares[len(progress.ids) % len(progress.spares)]
        progress.reserve = [(new_job_id(), spec)]
    count = progress.reserve_part if faults_left else len(progress.reserve)
    part, progress.reserve = progress.reserve[:count], progress.reserve[count:]
    try:
        progress.ids += [record.id for record in enqueue_jobs(conn, part)]
    except redis.RedisError:  # Redis restarting: submitted again on a later tick, under new ids
        progress.reserve = [(new_job_id(), spec) for _, spec in part] + progress.reserve


def cancel_due(conn, progress: Progress, states: dict[str, JobState]) -> None:
    for job_id, at_final in list(progress.cancel_at.items()):
        if progress.final >= at_final:
            del progress.cancel_at[job_id]
            if not states[job_id].is_final:
                with suppress(RingqError):  # it ended meanwhile
                    cancel_job(JobStore(conn), job_id)


def step_faults(injector, config: SoakConfig, progress: Progress, rng, pending: bool) -> None:
    now_s = time.monotonic()
    fault = progress.open_fault
    if fault is not None:
        if injector.recovered(fault, progress.finished, pending):
            fault.recovered_s = now_s - fault.at_s
        elif now_s - fault.at_s > RECOVERY_TIMEOUT_S:
            fault.notes.append(f"not recovered within {RECOVERY_TIMEOUT_S:.0f} s")
        else:
            return
        progress.open_fault = None
        progress.next_fault_at_s = now_s + rng.uniform(*config.fault_gap_s)
        return
    if not pending or len(progress.faults) >= config.faults or now_s < progress.next_fault_at_s:
        return
    try:
        injected = injector.inject(next_kind(config, progress, rng, now_s), progress.finished)
    except redis.RedisError:
        injected = None
    if injected is None:
        progress.next_fault_at_s = now_s  # nothing of that kind to hit now: again next tick
        return
    assert progress.drawn_at_s is not None
    if injected.at_s - progress.drawn_at_s > 1.0:
        injected.notes.append(f"waited {injected.at_s - progress.drawn_at_s:.0f} s for a target")
    progress.drawn_kind = progress.drawn_at_s = None
    progress.faults.append(injected)
    progress.open_fault = injected


def next_kind(config: SoakConfig, progress: Progress, rng: random.Random, now_s: float) -> str:
    """The next fault's kind: in turn when the config lists kinds, else drawn by weight. Either
    way it is kept until a fault of it is injected: redrawing whenever nothing of a kind could be
    hit favoured the kinds that always have a target (services) over busy ranks (a 200-job run
    drew rank-kill and rank-stop once each in 25 faults, against weights of 3 and 2 in 10)."""
    if progress.drawn_kind is None:
        if config.fault_kinds:
            progress.drawn_kind = config.fault_kinds[len(progress.faults) % len(config.fault_kinds)]
        else:
            progress.drawn_kind = pick_kind(rng)
        progress.drawn_at_s = now_s
    return progress.drawn_kind


def sample(conn, home: Path, started_s: float, final: int) -> dict:
    """RSS of each service (and the pid it was read from: a restart starts a new process), and
    the largest rank's."""
    rss: dict[str, int] = {}
    pids: dict[str, int] = {}
    try:
        statuses = read_service_statuses(conn)
    except redis.RedisError:
        statuses = []
    for status in statuses:
        try:
            rss[status.label] = psutil.Process(status.pid).memory_info().rss if status.pid else 0
        except psutil.Error:
            rss[status.label] = 0
        if rss[status.label] and status.pid:
            pids[status.label] = status.pid
    ranks = []
    for rank in rank_processes(home):
        with suppress(psutil.Error):  # it ended since it was listed
            ranks.append(psutil.Process(rank.pid).memory_info().rss)
    return {
        "t_s": time.monotonic() - started_s,
        "final": final,
        "rss": rss,
        "pids": pids,
        "ranks_max": max(ranks, default=0),
    }


def rss_growth(samples: list[dict], total: int) -> dict[str, float]:
    """Per service: the largest growth of any of its processes. A process is compared with
    itself only: its largest RSS once it has seen 10 % of the jobs (`total`) end and lived
    RSS_WARM_UP_S, over its largest RSS until then. A restarted service's new process starts
    cold, so comparing it with the first process's early peak would measure the restart, not a
    leak. A process that did not live past its early part gives no figure."""
    window = max(1, total // 10)
    lives: dict[tuple[str, int], list[tuple[float, int, int]]] = defaultdict(list)
    for s in samples:
        for label, pid in s.get("pids", {}).items():
            lives[(label, pid)].append((s["t_s"], s["final"], s["rss"][label]))
    growth: dict[str, float] = {}
    for (label, _), points in sorted(lives.items()):
        born_s, mark = points[0][0], points[0][1] + window
        early = [final <= mark or t_s - born_s <= RSS_WARM_UP_S for t_s, final, _ in points]
        before = [rss for (_, _, rss), is_early in zip(points, early, strict=True) if is_early]
        after = [rss for (_, _, rss), is_early in zip(points, early, strict=True) if not is_early]
        if before and after:
            growth[label] = max(growth.get(label, 0.0), max(after) / max(before))
    return growth


def settle(conn, home: Path, timeout_s: float = 90) -> tuple[dict[str, int], list]:
    """After the last job: wait for idle groups to retire and leases to lapse."""
    deadline = time.monotonic() + timeout_s
    while True:
        names = [s.label for s in read_service_statuses(conn) if s.label.startswith("node-")]
        reserved = reserved_per_node(conn, names)
        ranks = rank_processes(home)
        if (not any(reserved.values()) and not ranks) or time.monotonic() > deadline:
            return reserved, ranks
        time.sleep(TICK_S)


UP_STOP_S = 60.0


def stop_up(up: subprocess.Popen, home: Path) -> tuple[int | None, list, dict | None]:
    """Ctrl-C `up`; one that does not exit within UP_STOP_S is killed, after its output's tail
    and its still-alive children are logged and returned (so a run says why it hung)."""
    up.send_signal(signal.SIGINT)
    stuck = None
    try:
        code = up.wait(timeout=UP_STOP_S)
    except subprocess.TimeoutExpired:
        stuck = stuck_report(up, home)
        log.warning(
            "`ringq up` did not stop within %.0f s of SIGINT; still alive: %s; ranks: %s; "
            "its output ends:\n%s",
            UP_STOP_S,
            json.dumps(stuck["alive"]),
            json.dumps(stuck["ranks"]),
            stuck["output_tail"],
        )
        up.kill()
        code = None
    time.sleep(1.0)
    return code, rank_processes(home), stuck


def thread_waits(pid: int) -> list[str]:
    """Where each thread of `pid` waits in the kernel (Linux /proc; empty elsewhere): a main
    thread in futex_wait holds out on a lock, one in do_sys_poll on a socket."""
    found = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        with suppress(OSError):
            found.append(f"{task.name}:{(task / 'wchan').read_text().strip() or '-'}")
    return found


def stuck_report(up: subprocess.Popen, home: Path, lines: int = 40) -> dict:
    """`up`'s output tail, every process still alive under it, and every rank of this home (one
    orphaned by a killed agent is no longer under `up`)."""
    alive = []
    with suppress(psutil.Error):
        for proc in [psutil.Process(up.pid), *psutil.Process(up.pid).children(recursive=True)]:
            with suppress(psutil.Error):
                command = " ".join(proc.cmdline())
                waits = thread_waits(proc.pid)
                alive.append(
                    {"pid": proc.pid, "status": proc.status(), "cmdline": command, "waits": waits}
                )
    ranks = [asdict(r) for r in rank_processes(home)]
    output = (home / "up.out").read_text(errors="replace").splitlines()
    return {"alive": alive, "ranks": ranks, "output_tail": "\n".join(output[-lines:])}


@dataclass
class Ending:
    """What the soak found once the load was done."""

    verdict: Verdict
    retries: list[int]
    reserved: dict[str, int]
    ranks_left: list[RankProcess]
    stopped_left: list[int]
    up_exit_code: int | None
    up_stuck: dict | None  # stuck_report when `up` had to be killed
    reference_jobs: int
    phases_s: dict[str, float]


def run_soak(config: SoakConfig, home: Path, env_extra: dict[str, str] | None = None) -> dict:
    rng = random.Random(config.seed)
    settings = Settings(home=home, redis_url=None)
    phases_s: dict[str, float] = {}
    mark_s = time.monotonic()

    def phase(name: str) -> None:
        nonlocal mark_s
        phases_s[name] = time.monotonic() - mark_s
        mark_s = time.monotonic()

    up = start_up(home, env_extra or {})
    phase("start")
    try:
        conn = connect(unix_url(home / "redis" / SOCKET_NAME), ride_out_s=60)
        load = draw_load(
            config.jobs, rng, home / "batches", config.smollm2_share, config.documents_tokens
        )
        reference = run_reference(conn, reference_specs(load, settings))
        phase("reference")
        reserve = load.direct[: round(len(load.direct) * RESERVE_SHARE)]
        load.direct = load.direct[len(reserve) :]
        ids = submit_load(conn, load, settings)
        cancelled = rng.sample(ids, round(len(ids) * CANCEL_SHARE))
        progress = Progress(ids, {j: rng.randrange(0, max(1, len(ids) // 2)) for j in cancelled})
        progress.reserve = reserve
        progress.spares = [spec for _, spec in reserve] or [spec for _, spec in load.direct]
        progress.reserve_part = max(1, len(reserve) // max(1, config.faults))
        injector = Injector(conn, home, rng, rank_patience_s=TICK_S)
        soak_loop(conn, injector, config, progress)
        phase("load")
        stopped_left = injector.release_stopped()
        reserved, ranks_left = settle(conn, home)
        phase("settle")
        verdict = check_jobs(JobStore(conn), ids, reference, home)
        retries = [JobStore(conn).get(j).attempt for j in ids]
        code, ranks_after_stop, stuck = stop_up(up, home)
        phase("stop")
    finally:
        if up.poll() is None:
            up.kill()
        shutdown_embedded(settings)
    ending = Ending(
        verdict,
        retries,
        reserved,
        ranks_left + ranks_after_stop,
        stopped_left,
        code,
        stuck,
        len(reference),
        phases_s,
    )
    return summarise(config, progress, ending)


def summarise(config: SoakConfig, progress: Progress, end: Ending) -> dict:
    verdict, wall_s = end.verdict, end.phases_s["load"]
    recover = sorted(f.recovered_s for f in progress.faults if f.recovered_s is not None)
    growth = rss_growth(progress.samples, config.jobs)
    services_growth = {k: v for k, v in growth.items() if k != "redis"}
    invariants = {
        "all_final": verdict.final == len(progress.ids),
        "none_lost": not verdict.lost,
        "none_completed_twice": not verdict.completed_twice,
        "texts_equal_reference": not verdict.text_mismatches,
        "reservations_zero": not any(end.reserved.values()),
        "no_rank_left": not end.ranks_left and not end.stopped_left,
        "service_rss_growth_le_10pct": all(v <= RSS_GROWTH_LIMIT for v in services_growth.values()),
        "up_stopped_cleanly": end.up_exit_code == 0,
        "every_fault_recovered": len(recover) == len(progress.faults),
    }
    return {
        "config": {**asdict(config), "env": ENV},
        "jobs": len(progress.ids),
        "reference_jobs": end.reference_jobs,
        "wall_s": wall_s,
        "phases_s": end.phases_s,
        "jobs_per_min": len(progress.ids) / wall_s * 60,
        "states": verdict.states,
        "faults_by_kind": dict(Counter(f.kind for f in progress.faults)),
        "faults_injected": len(progress.faults),
        "recover_s": {
            "median": statistics.median(recover) if recover else None,
            "p99": recover[min(len(recover) - 1, int(0.99 * len(recover)))] if recover else None,
            "max": recover[-1] if recover else None,
        },
        "retries": {"total": sum(end.retries), "jobs_retried": sum(a > 0 for a in end.retries)},
        "rss_growth": growth,
        "invariants": invariants,
        "problems": {
            "lost": verdict.lost,
            "completed_twice": verdict.completed_twice,
            "text_mismatches": verdict.text_mismatches,
            "without_reference": verdict.without_reference,
            "failed": verdict.failed_errors[:20],
            "reserved_bytes": end.reserved,
            "ranks_left": [asdict(r) for r in end.ranks_left],
            "stopped_ranks_left": end.stopped_left,
            "up_stuck": end.up_stuck,
        },
        "faults": [f.report() for f in progress.faults],
        "samples": progress.samples,
    }


@click.command()
@click.option("--jobs", "job_count", default=1000, show_default=True)
@click.option("--faults", "fault_count", default=60, show_default=True)
@click.option("--no-faults", is_flag=True, help="The fault-free baseline of the same load.")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--home", type=click.Path(path_type=Path), default=None, help="Default: a new /tmp dir."
)
def main(job_count: int, fault_count: int, no_faults: bool, seed: int, home: Path | None) -> None:
    """Run the soak (see the module docstring) and write its JSON."""
    from tests.helpers import short_tmp_dir

    config = SoakConfig(jobs=job_count, faults=0 if no_faults else fault_count, seed=seed)
    home = home or short_tmp_dir("ringq-chaos-")
    home.mkdir(parents=True, exist_ok=True)
    result = run_soak(config, home)
    name = f"chaos-fault-free-{job_count}" if no_faults else f"chaos-{job_count}"
    baseline = OUT / f"chaos-fault-free-{job_count}.json"
    if not no_faults and baseline.exists():
        base = json.loads(baseline.read_text())
        result["throughput_vs_fault_free"] = result["jobs_per_min"] / base["jobs_per_min"]
    result["when"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    result["command"] = " ".join(["python -m bench.chaos.soak", *sys.argv[1:]])
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    shown = {k: v for k, v in result.items() if k not in ("faults", "samples", "config")}
    click.echo(json.dumps(shown, indent=1, default=str))
    click.echo(f"written: {OUT / f'{name}.json'}")


if __name__ == "__main__":
    main()
