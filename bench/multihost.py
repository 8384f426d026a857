"""The multi-host rehearsal: ringq on three "hosts" with their own network and disks
(bench/multihost_hosts.py), and the failures that only happen between machines.

    sudo uv run python -m bench.multihost                 # every scenario -> results/multihost.json
    sudo uv run python -m bench.multihost --only ring2_same_as_single --out /tmp/x.json

Host a runs Redis over TCP with requirepass (AOF on its own disk), the dispatcher and
`ringq serve`; hosts b and c run `ringq node` each. Every process reaches Redis as
redis://:PASSWORD@10.78.0.1:6379/0; this process watches through the bridge.
"""

import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import click

from bench.multihost_cluster import (
    API_KEY,
    LONG_DOCUMENT,
    MODEL,
    PASSWORD,
    Cluster,
    progress_at,
    wait,
)
from bench.multihost_hosts import Hosts, namespaces_unavailable
from bench.multihost_tls import tls_to_redis
from jobs.checkpoint_marks import read_marks
from jobs.lifecycle import JobState
from jobs.redis_server import tcp_url

OUT = Path(__file__).parent / "results" / "multihost.json"


def ring2_same_as_single(cluster: Cluster) -> str:
    """`ringq submit` on a, a ring-2 over b and c and a single; the same answer."""
    answers = {}
    for ranks in ("2", "1"):
        out = cluster.cli(
            "submit",
            "generate",
            "-",
            "--prompt",
            "Go on.",
            "--max-tokens",
            "8",
            "--model",
            MODEL,
            "--ranks",
            ranks,
            "--json",
            input_text=LONG_DOCUMENT[:1500],
        )
        assert out.returncode == 0, out.stderr
        job_id = json.loads(out.stdout)["id"]
        record = cluster.final(job_id)
        assert record.state == JobState.FINISHED and record.result and record.placement, (
            record.error
        )
        answers[ranks] = (record.result.text, record.placement.nodes, record.result.cached_tokens)
    assert answers["2"][1] == ["b", "c"], answers
    assert answers["2"][0] == answers["1"][0], answers
    models = http_status(cluster.a.address, "/v1/models", API_KEY)
    refused = http_status(cluster.a.address, "/v1/models", None)
    assert (models, refused) == (200, 401), (models, refused)
    return (
        f"ring-2 on {answers['2'][1]} and single on {answers['1'][1]} answer {answers['1'][0]!r}"
        f" (cached tokens {answers['2'][2]}, {answers['1'][2]}); `ringq serve` on a: "
        f"/v1/models {models} with the key, {refused} without"
    )


def http_status(address: str, path: str, key: str | None) -> int:
    request = urllib.request.Request(f"http://{address}:8000{path}")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def prefix_across_hosts(cluster: Cluster) -> str:
    """A prefix kept on one node, asked for by a job placed on the other (the keeper away)."""
    document = "Prefix reuse across machines. " * 40
    first = cluster.final(cluster.submit(document, ranks=1).id)
    assert first.state == JobState.FINISHED and first.placement and first.result, first.error
    keeper = first.placement.nodes[0]
    other = "c" if keeper == "b" else "b"
    agent = cluster.agents[keeper]
    agent.send_signal(signal.SIGSTOP)  # the keeper stops heartbeating, as if busy elsewhere
    try:
        wait(lambda: keeper not in cluster.live(), f"{keeper} to drop out", 30)
        second = cluster.final(cluster.submit(document, ranks=1).id)
    finally:
        agent.send_signal(signal.SIGCONT)
    cluster.wait_nodes({"b", "c"})
    assert second.state == JobState.FINISHED and second.placement and second.result, second.error
    assert second.placement.nodes == [other], second.placement
    assert second.result.text == first.result.text
    how = "fetched" if second.result.cached_tokens else "recomputed"
    return (
        f"kept on {keeper} ({first.result.prompt_tokens} tokens); the job placed on {other} "
        f"{how} it (cached_tokens {second.result.cached_tokens}, source "
        f"{second.result.cache_source}); same answer"
    )


def agent_restart_resumes(cluster: Cluster) -> str:
    """A ring-2 prefill on b+c; b's agent killed late in it and started again (files kept)."""
    record = cluster.submit("Resume. " + LONG_DOCUMENT, ranks=2)
    late = wait(lambda: progress_at(cluster, record.id, 0.6), "60 % of the prefill", 240)
    wait(lambda: len(read_marks(cluster.store.conn, record.id)) == 2, "both ranks' marks", 60)
    cluster.kill_agent("b")
    time.sleep(1.0)
    cluster.start_agent("b")
    end = cluster.final(record.id, 240)
    assert end.state == JobState.FINISHED and end.placement, (end.state, end.error)
    assert end.attempt == 1, end.retry_reasons
    assert "continues from its checkpoint" in (end.placement.reason or ""), end.placement
    return (
        f"killed at {late.progress.processed}/{late.progress.total} tokens on "
        f"{late.placement.nodes if late.placement else '?'}; retry: {end.placement.reason!r} "
        f"(lost because: {end.retry_reasons[0]!r})"
    )


def node_joins_mid_batch(cluster: Cluster) -> str:
    """c's agent stopped; 8 jobs queued; c starts again after the first ones and takes work."""
    cluster.kill_agent("c")
    wait(lambda: "c" not in cluster.live(), "c to drop out", 30)
    ids = [cluster.submit(f"Batch item {i}. " + "Some text to read. " * 60).id for i in range(8)]
    store = cluster.store
    wait(lambda: any(store.get(i).state.is_final for i in ids), "the first job on b", 120)
    cluster.start_agent("c")
    records = [cluster.final(job_id, 240) for job_id in ids]
    assert all(r.state == JobState.FINISHED for r in records), [r.error for r in records]
    on_c = [r.id for r in records if r.placement and "c" in r.placement.nodes]
    assert on_c, "c took no work"
    return f"c joined after the first job finished; it ran {len(on_c)} of 8 jobs"


def redis_restart_under_load(cluster: Cluster) -> str:
    """12 jobs queued; Redis on a stopped (SIGTERM, AOF fsynced) and started again."""
    ids = [cluster.submit(f"Load item {i}. " + "More text here. " * 40).id for i in range(12)]
    assert cluster.redis is not None
    store = cluster.store
    wait(lambda: any(store.get(i).state.is_final for i in ids), "the first job to end", 120)
    cluster.redis.terminate()
    cluster.redis.wait(timeout=20)
    time.sleep(2.0)
    cluster.start_redis()
    records = [cluster.final(job_id, 300) for job_id in ids]
    states = [r.state.value for r in records]
    assert all(s == JobState.FINISHED.value for s in states), states
    runs = {job_id: cluster.completions(job_id) for job_id in ids}
    assert set(runs.values()) == {1}, runs
    return "Redis down 2 s under 12 jobs: all finished, each run to completion exactly once"


def link_cut_a_b(cluster: Cluster) -> str:
    """b loses host a (Redis) mid-ring: the group fails cleanly and the retry avoids b."""
    b = cluster.hosts["b"]
    record = cluster.submit(
        "Cut. " + LONG_DOCUMENT
    )  # auto: a ring of b and c, free to shrink on retry
    started = wait(lambda: progress_at(cluster, record.id, 0.2), "20 % of the prefill", 240)
    assert started.placement and set(started.placement.nodes) == {"b", "c"}, started.placement
    b.block(cluster.a, True)
    cluster.a.block(b, True)
    try:
        end = cluster.final(record.id, 240)
    finally:
        b.block(cluster.a, False)
        cluster.a.block(b, False)
    assert end.state == JobState.FINISHED and end.placement, (end.state, end.error)
    assert "b" not in end.placement.nodes, end.placement
    cluster.wait_nodes({"b", "c"}, 90)
    return f"retry on {end.placement.nodes} after {end.retry_reasons!r}; b back once the link was"


def bad_start(cluster: Cluster) -> str:
    """A wrong Redis password and a wrong --address: one clear line each, at start."""
    b = cluster.hosts["b"]
    wrong_url = tcp_url(cluster.a.address, 6379, "not-the-password")
    lines = []
    for env, address in (({"RINGQ_REDIS_URL": wrong_url}, b.address), ({}, "10.78.0.3")):
        command = [sys.executable, "-m", "cli.main", "node", "--name", "bad", "--address", address]
        started = time.monotonic()
        out = b.run(command, {**cluster.env, **env}, timeout_s=60)
        took_s = time.monotonic() - started
        text = (out.stdout + out.stderr).strip()
        assert out.returncode != 0 and took_s < 30, (out.returncode, took_s, text)
        assert "Traceback" not in text and len(text.splitlines()) == 1, text
        assert PASSWORD not in text and "not-the-password" not in text, text
        lines.append(f"{text} (exit {out.returncode}, {took_s:.1f} s)")
    assert "bad" not in cluster.live()
    return " | ".join(lines)


def host_b_gone(cluster: Cluster) -> str:
    """b destroyed mid-ring (processes, network, disk): the job ends on c; nothing waits for b."""
    record = cluster.submit("Gone. " + LONG_DOCUMENT)  # a prompt no node keeps
    started = wait(lambda: progress_at(cluster, record.id, 0.5), "half the prefill", 240)
    assert started.placement and set(started.placement.nodes) == {"b", "c"}, started.placement
    cluster.agents.pop("b", None)
    gone_at = time.monotonic()
    cluster.hosts["b"].destroy()
    end = cluster.final(record.id, 240)
    took_s = time.monotonic() - gone_at
    assert end.state == JobState.FINISHED and end.placement, (end.state, end.error)
    assert end.placement.nodes == ["c"], end.placement
    wait(lambda: "b" not in cluster.live(), "b to drop out", 30)
    return (
        f"finished on c {took_s:.1f} s after b was destroyed: {end.placement.reason!r} "
        f"(lost because: {end.retry_reasons!r}); {explicit_ring_without_b(cluster)}"
    )


def explicit_ring_without_b(cluster: Cluster) -> str:
    """What a job that asks for 2 ranks does once only c is left (observed, then cancelled)."""
    store = cluster.store
    record = cluster.submit("Two ranks asked for. " * 30, ranks=2)
    time.sleep(10)
    seen = store.get(record.id)
    cluster.cli("cancel", record.id)
    return (
        f"a job asking for ranks=2 then: {seen.state.value}, {seen.waiting_reason or seen.error!r}"
    )


SCENARIOS: dict[str, Callable[[Cluster], str]] = {
    "ring2_same_as_single": ring2_same_as_single,
    "bad_password_and_address": bad_start,
    "prefix_across_hosts": prefix_across_hosts,
    "agent_restart_resumes": agent_restart_resumes,
    "node_joins_mid_batch": node_joins_mid_batch,
    "redis_restart_under_load": redis_restart_under_load,
    "link_cut_a_b": link_cut_a_b,
    "tls_to_redis": tls_to_redis,
    "host_b_gone": host_b_gone,  # last: b does not come back
}


def run_scenarios(names: list[str], tls_server: Path | None) -> list[dict]:
    results = []
    with Hosts() as hosts:
        cluster = Cluster(hosts, tls_server)
        cluster.start()
        for name in names:
            started = time.monotonic()
            try:
                entry = {"name": name, "ok": True, "detail": SCENARIOS[name](cluster)}
            except Exception as exc:
                entry = {"name": name, "ok": False, "detail": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            entry["seconds"] = round(time.monotonic() - started, 1)
            print(json.dumps(entry), flush=True)
            results.append(entry)
    return results


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip()


@click.command()
@click.option("--only", multiple=True, type=click.Choice(list(SCENARIOS)), help="Scenarios.")
@click.option("--out", type=click.Path(path_type=Path), default=OUT, show_default=True)
@click.option(
    "--tls-server",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A redis-server built with TLS for tls_to_redis (default: ringq's own).",
)
def main(only: tuple[str, ...], out: Path, tls_server: Path | None) -> None:
    """Run the rehearsal and write its scenarios' outcomes as JSON."""
    if why := namespaces_unavailable():
        raise click.ClickException(why)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still remove the hosts
    started = time.monotonic()
    scenarios = run_scenarios(list(only) or list(SCENARIOS), tls_server)
    report = {
        "command": "python -m bench.multihost " + " ".join(sys.argv[1:]),
        "commit": commit(),
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
        "wall_s": round(time.monotonic() - started, 1),
        "scenarios": scenarios,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{sum(s['ok'] for s in scenarios)}/{len(scenarios)} ok in {report['wall_s']} s: {out}")


if __name__ == "__main__":
    main()
