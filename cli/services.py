"""Long-running services: `ringq up`, `ringq demo`, `ringq node`, `ringq dispatcher`."""

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib.resources import files
from pathlib import Path

import click
import psutil
from rich.console import Console

from cli.common import interrupt_on_sigterm, redis_url_for
from cli.render import print_result, result_json, watch
from cli.supervisor import Supervisor
from jobs.dispatcher import serve
from jobs.errors import RingqError
from jobs.redis_server import SERVICE_RIDE_OUT_S, RedisHandle, connect, ensure_redis
from jobs.schemas import JobKind, JobSpec
from jobs.settings import Settings, get_settings
from jobs.store import JobStore
from jobs.submit import submit_job
from ring_worker.node_agent import NodeAgent, log_tail

console = Console(stderr=True)
READY_TIMEOUT_S = 60.0
PARENT_PID_ENV = "RINGQ_PARENT_PID"


class LocalCluster:
    """Redis (embedded unless RINGQ_REDIS_URL), a dispatcher and N node agents, as children."""

    def __init__(
        self,
        settings: Settings,
        node_count: int,
        name_prefix: str = "node",
        extra_env: dict[str, str] | None = None,
    ):
        self.settings = settings
        self.extra_env = extra_env or {}
        self.node_names = [f"{name_prefix}-{i}" for i in range(node_count)]
        self.redis: RedisHandle | None = None
        self.children: list[tuple[str, subprocess.Popen, Path]] = []
        self._commands: dict[str, tuple[list[str], dict[str, str]]] = {}

    def __enter__(self) -> "LocalCluster":
        self.redis = ensure_redis(self.settings)
        env = {
            **os.environ,
            "RINGQ_REDIS_URL": self.redis.url,
            "RINGQ_HOME": str(self.settings.home),
            PARENT_PID_ENV: str(os.getpid()),
            **self.extra_env,
        }
        logs = self.settings.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        try:
            self._spawn("dispatcher", ["dispatcher"], env, logs)
            share = local_node_share_gib(max(1, len(self.node_names)))
            for name in self.node_names:
                limit = [] if "RINGQ_NODE_MEMORY_LIMIT_GIB" in env else ["--memory-limit", share]
                self._spawn(name, ["node", "--name", name, *limit], env, logs)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def restart(self, label: str) -> subprocess.Popen:
        """Start the service `label` again (after it died or was killed) with its command."""
        args, env = self._commands[label]
        self.children = [child for child in self.children if child[0] != label]
        self._spawn(label, args, env, self.settings.home / "logs")
        return self.children[-1][1]

    def _spawn(self, label: str, args: list[str], env: dict[str, str], logs: Path) -> None:
        self._commands[label] = (args, env)
        log_path = logs / f"{label}.log"
        with open(log_path, "ab") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "cli.main", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.children.append((label, process, log_path))

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until every node agent has registered; a child that dies is reported with its log."""
        store = JobStore(connect(self.url))
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_children()
            live = {n.name for n in store.live_nodes()}
            if set(self.node_names) <= live:
                return
            if time.monotonic() > deadline:
                raise RingqError(f"nodes not ready after {timeout_s:.0f} s: {sorted(live)}")
            time.sleep(0.2)

    def check_children(self) -> None:
        for label, process, log_path in self.children:
            if process.poll() is not None:
                raise RingqError(
                    f"{label} exited with code {process.returncode}: {log_tail(log_path)}"
                )

    @property
    def url(self) -> str:
        assert self.redis is not None
        return self.redis.url

    def __exit__(self, *exc_info: object) -> None:
        # A second Ctrl-C must not cut the cleanup short and orphan the services.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self._stop_children()
        finally:
            signal.signal(signal.SIGINT, previous)

    def _stop_children(self) -> None:
        for _, process, _ in self.children:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for _, process, _ in self.children:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.redis is not None:
            self.redis.stop()  # only if we started it


@click.command()
@click.option(
    "--nodes",
    "node_count",
    type=click.IntRange(1, 16),
    default=2,
    show_default=True,
    help="Local node agents to start.",
)
def up(node_count: int) -> None:
    """Start Redis (unless RINGQ_REDIS_URL), the dispatcher and local node agents; Ctrl-C stops."""
    settings = get_settings()
    interrupt_on_sigterm()
    with LocalCluster(settings, node_count) as cluster:
        cluster.wait_ready()
        console.print(
            f"ringq up: redis {cluster.url}, dispatcher, {node_count} node(s): "
            f"{', '.join(cluster.node_names)}. Logs in {settings.home / 'logs'}. Ctrl-C stops."
        )
        console.print(f"[dim]other shells: export RINGQ_REDIS_URL={cluster.url}[/dim]")
        supervisor = Supervisor(cluster, say=lambda text: console.print(f"ringq up: {text}"))
        try:
            while True:
                supervisor.tick()
                time.sleep(0.5)
        except KeyboardInterrupt:
            console.print("stopping ...")
        finally:
            supervisor.close()


@click.command()
@click.option("--model", default=None, help="Model (default: smollm2).")
@click.option("--ring-size", type=click.IntRange(1, 8), default=2, show_default=True)
@click.option("--max-tokens", type=int, default=96, show_default=True)
def demo(model: str | None, ring_size: int, max_tokens: int) -> None:
    """Everything local: a bundled document and a question through a ring of local nodes."""
    settings = get_settings()
    interrupt_on_sigterm()
    document = files("cli").joinpath("demo/document.md").read_text()
    question = files("cli").joinpath("demo/question.txt").read_text().strip()
    started = time.perf_counter()
    with LocalCluster(settings, ring_size, name_prefix="demo") as cluster:
        cluster.wait_ready()
        console.print(f"[dim]cluster ready in {time.perf_counter() - started:.1f}s[/dim]")
        spec = JobSpec(
            kind=JobKind.GENERATE,
            document=document,
            document_name="demo/document.md",
            model=model or settings.default_model,
            prompt=question,
            max_tokens=max_tokens,
            ring_size=ring_size,
        )
        conn = connect(cluster.url)
        record = submit_job(conn, spec)
        console.print(f"job {record.id}: {question}")
        record = watch(JobStore(conn), record.id, console)
        out = Console()
        out.print(f"\n[bold]{question}[/bold]\n[bold]Answer:[/bold] ", end="")
        print_result(out, result_json(record))
        if record.placement:
            out.print(
                f"[dim]{record.placement.strategy}-{record.placement.ring_size} on "
                f"{', '.join(record.placement.nodes)}; "
                f"total {time.perf_counter() - started:.1f}s[/dim]"
            )
    if record.error:
        sys.exit(1)


@click.command()
@click.option("--name", default=None, help="Node name (default: the host name).")
@click.option(
    "--address",
    default="127.0.0.1",
    show_default=True,
    help="Address this node's ranks listen on (reachable by the other nodes).",
)
@click.option("--memory-limit", type=float, default=None, help="GiB ringq may use on this node.")
def node(name: str | None, address: str, memory_limit: float | None) -> None:
    """Run a node agent: register, heartbeat, start rank processes when asked."""
    settings = get_settings()
    setup_service()
    url = redis_url_for(settings)
    limit_gib = memory_limit or settings.node_memory_limit_gib
    agent = NodeAgent(
        name or socket.gethostname(),
        connect(url, ride_out_s=SERVICE_RIDE_OUT_S),
        url,
        settings,
        address=address,
        memory_limit_bytes=int(limit_gib * 1024**3) if limit_gib else None,
    )
    agent.run()


def local_node_share_gib(nodes: int) -> str:
    """`ringq up`'s nodes share one machine: each may reserve an equal share of its memory."""
    return f"{psutil.virtual_memory().total / nodes / 1024**3:.2f}"


@click.command()
def dispatcher() -> None:
    """Run the dispatcher: admit, place and hand over submitted jobs."""
    setup_service()
    settings = get_settings()
    serve(connect(redis_url_for(settings), ride_out_s=SERVICE_RIDE_OUT_S), settings)


def setup_service() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if parent := os.environ.get(PARENT_PID_ENV):
        exit_with_parent(int(parent))


def exit_with_parent(parent_pid: int) -> None:
    """Services started by `ringq up` stop (warm, via SIGTERM) if it dies without stopping them."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()
