"""A link between two nodes goes down mid-prefill. The nodes live in two network namespaces joined
by a veth pair (tests/jobs/netns_nodes.sh, inside this test's own user namespace); Redis is
reached through its unix socket, so only the link between the ranks is cut. The group must fail
cleanly (the stall watchdog) and the job be retried on a layout the cut does not touch."""

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.services import LocalCluster
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobSpec
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import (
    LONG_DOCUMENT,
    final_record,
    in_prefill,
    rank_processes,
    short_tmp_dir,
    wait_for,
)

SCRIPT = Path(__file__).with_name("netns_nodes.sh")
STALL_TIMEOUT_S = 5
ENV = {
    "RINGQ_PREFIX_CACHE": "off",  # these prompts must be computed, not taken from a cache
    "RINGQ_STALL_TIMEOUT_S": str(STALL_TIMEOUT_S),
    "RINGQ_PREFILL_CHUNK_TOKENS": "64",
    "RINGQ_RANK_PORT_BASE": "34300",
}


def namespaces_unavailable() -> str | None:
    tools = [t for t in ("unshare", "nsenter", "ip") if shutil.which(t) is None]
    if tools:
        return f"missing {', '.join(tools)} (util-linux, iproute2)"
    probe = subprocess.run(
        ["unshare", "-r", "-n", "--", "ip", "link", "add", "v0", "type", "veth", "peer", "v1"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"this sandbox cannot make network namespaces: {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def split_cluster() -> Iterator[tuple[LocalCluster, list[int]]]:
    """Redis and the dispatcher here; nodes cut-0 and cut-1 in their own namespaces."""
    if why := namespaces_unavailable():
        pytest.skip(why)
    home = short_tmp_dir("ringq-cut-")
    settings = Settings(home=home, redis_url=None)
    try:
        with LocalCluster(settings, 0, extra_env=ENV) as cluster:
            env = {**os.environ, **ENV, "RINGQ_REDIS_URL": cluster.url, "RINGQ_HOME": str(home)}
            nodes = subprocess.Popen(
                ["unshare", "-r", "-n", "--", "bash", str(SCRIPT), str(home), "cut-0", "cut-1"]
                + [sys.executable],
                env=env,
                start_new_session=True,
            )
            try:
                store = JobStore(connect(cluster.url))
                wait_for(lambda: len(store.live_nodes()) == 2, "the two namespaced nodes")
                pids = [int(p) for p in (home / "pids").read_text().split()]
                yield cluster, pids
            finally:
                nodes.send_signal(signal.SIGTERM)
                nodes.wait(timeout=30)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def in_namespace(pid: int, *command: str) -> str:
    return subprocess.run(
        ["nsenter", "-t", str(pid), "-n", *command], capture_output=True, text=True, check=True
    ).stdout


def test_a_cut_link_fails_the_group_cleanly_and_the_retry_avoids_it(split_cluster, tiny_llama_dir):
    cluster, (namespace_a, namespace_b) = split_cluster
    store = JobStore(connect(cluster.url))
    spec = JobSpec(kind=JobKind.PREFILL, document=LONG_DOCUMENT, model=str(tiny_llama_dir))
    record = submit_job(store.conn, spec)
    record = wait_for(lambda: in_prefill(store.get(record.id)), "prefill to start")
    assert record.placement.nodes == ["cut-0", "cut-1"]  # a ring across the link
    # the ranks talk over the veth pair, between the addresses their nodes gave
    connections = in_namespace(namespace_a, "ss", "-Htn")
    assert "10.77.0.1:" in connections and "10.77.0.2:" in connections, connections
    in_namespace(namespace_a, "ip", "link", "set", "va", "down")
    final = wait_for(lambda: final_record(store, record.id), "the job to end", timeout_s=120)
    assert final.state == JobState.FINISHED, final.error
    assert final.attempt == 1 and final.placement.ranks == 1
    assert "stalled" in final.retry_reasons[0], final.retry_reasons
    wait_for(lambda: not rank_processes(record.placement.group_id), "the cut group's ranks to end")
