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
from cli.options import renamed_option
from cli.render import print_result, result_json, watch
from cli.supervisor import Supervisor
from jobs.dispatcher import serve
from jobs.errors import RingqError
from jobs.redis_server import SERVICE_RIDE_OUT_S, RedisHandle, connect, ensure_redis
from jobs.schemas import JobKind, JobSpec
from jobs.settings import Settings, get_settings
from jobs.store import JobStore
from jobs.submit import submit_job
from ring_worker.engine.devices import LocalNode, cuda_memory_bytes, installed_gpus, local_nodes
from ring_worker.runtime.node_agent import NodeAgent, log_tail

console = Console(stderr=True)
log = logging.getLogger(__name__)
READY_TIMEOUT_S = 60.0


class LocalCluster:
    """Redis (embedded unless RINGQ_REDIS_URL), a dispatcher and N node agents, as children."""

    def __init__(
        self,
        settings: Settings,
        node_count: int | None = None,
        name_prefix: str = "node",
        extra_env: dict[str, str] | None = None,
        gpus: list[str] | None = None,
    ):
        """`node_count` None: one node per GPU (`gpus`, default this machine's), 2 on CPU."""
        self.settings = settings
        self.extra_env = extra_env or {}
        if gpus is None:
            gpus = local_gpus(settings)
        self.nodes = local_nodes(gpus, node_count, name_prefix)
        self.node_names = [node.name for node in self.nodes]
        self.redis: RedisHandle | None = None
        self.children: list[tuple[str, subprocess.Popen, Path]] = []
        self._commands: dict[str, tuple[list[str], dict[str, str]]] = {}

    def __enter__(self) -> "LocalCluster":
        self.redis = ensure_redis(self.settings)
        env = {
            **os.environ,
            "RINGQ_REDIS_URL": self.redis.url,
            "RINGQ_HOME": str(self.settings.home),
            "RINGQ_PARENT_PID": str(os.getpid()),
            **self.extra_env,
        }
        logs = self.settings.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        try:
            self._spawn("dispatcher", ["dispatcher"], env, logs)
            for node in self.nodes:
                args, node_env = self.node_command(node, env)
                self._spawn(node.name, args, node_env, logs)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def node_command(
        self, node: LocalNode, env: dict[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """`ringq node` for one local node: pinned to its GPU, with its share of the memory
        (of the host on CPU, of its GPU where several nodes share one)."""
        args = ["node", "--name", node.name]
        if node.gpu is not None:
            args += ["--gpus", node.gpu] + (["--share-gpu"] if node.shares_gpu else [])
        if "RINGQ_NODE_MEMORY_LIMIT_GIB" not in env:
            sharers = (
                sum(1 for n in self.nodes if n.gpu == node.gpu)
                if node.gpu is not None
                else len(self.nodes)
            )
            if sharers > 1:
                args += ["--memory-limit", local_node_share_gib(sharers, node.gpu)]
        return args, env

    def describe(self) -> str:
        """What `up` started, saying when nodes share a GPU (their rings use MLX's ring
        backend over TCP, not NCCL)."""
        parts = [
            f"{n.name} (GPU {n.gpu}{', shared' if n.shares_gpu else ''})" if n.gpu else n.name
            for n in self.nodes
        ]
        text = f"{len(self.nodes)} node(s): {', '.join(parts)}"
        if any(n.shares_gpu for n in self.nodes):
            text += (
                ". Nodes that share a GPU split its memory, and groups spanning them use "
                "MLX's ring backend, never NCCL"
            )
        return text

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
        for label, process, log_path in self.children:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                log.warning(
                    "ringq up: %s (pid %s) did not stop within 15 s of SIGTERM; killing it "
                    "(its log: %s)",
                    label,
                    process.pid,
                    log_path,
                )
                process.kill()
                process.wait()
        if self.redis is not None:
            self.redis.stop()  # only if we started it


@click.command()
@click.option(
    "--nodes",
    "node_count",
    type=click.IntRange(1, 16),
    default=None,
    help="Local node agents to start. Default: one per GPU, each pinned to its own; 2 on a "
    "machine without GPUs. More nodes than GPUs share them.",
)
def up(node_count: int | None) -> None:
    """Start Redis (unless RINGQ_REDIS_URL), the dispatcher and local node agents; Ctrl-C stops."""
    settings = get_settings()
    interrupt_on_sigterm()
    with LocalCluster(settings, node_count) as cluster:
        cluster.wait_ready()
        console.print(
            f"ringq up: redis {cluster.url}, dispatcher, {cluster.describe()}. "
            f"Logs in {settings.home / 'logs'}. Ctrl-C stops."
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
@click.option(
    "--ranks",
    type=click.IntRange(1, 8),
    default=None,
    help="Nodes, one rank each (default: one per GPU, or 2 on a CPU machine).",
)
@renamed_option("--ring-size", "--ranks", "ranks", type=click.IntRange(1, 8))
@click.option("--max-tokens", type=int, default=96, show_default=True)
def demo(model: str | None, ranks: int | None, max_tokens: int) -> None:
    """Everything local: a bundled document and a question through a ring of local nodes."""
    settings = get_settings()
    ranks = ranks or demo_ranks(settings)
    interrupt_on_sigterm()
    document = files("cli").joinpath("demo/document.md").read_text()
    question = files("cli").joinpath("demo/question.txt").read_text().strip()
    started = time.perf_counter()
    with LocalCluster(settings, ranks, name_prefix="demo") as cluster:
        cluster.wait_ready()
        console.print(
            f"[dim]cluster ready in {time.perf_counter() - started:.1f}s: "
            f"{cluster.describe()}[/dim]"
        )
        if any(n.gpu is not None for n in cluster.nodes):
            console.print(
                "[dim]on GPUs, each group compiles its kernels once while it loads (a few "
                "seconds, more on a machine's very first run)[/dim]"
            )
        spec = JobSpec(
            kind=JobKind.GENERATE,
            document=document,
            document_name="demo/document.md",
            model=model or settings.default_model,
            prompt=question,
            max_tokens=max_tokens,
            ranks=ranks,
        )
        conn = connect(cluster.url)
        record = submit_job(conn, spec)
        console.print(f"job {record.id}: {question}")
        record = watch(JobStore(conn), record.id, console)
        out = Console()
        out.print(f"\n[bold]{question}[/bold]\n[bold]Answer:[/bold] ", end="")
        print_result(out, result_json(record))
        if record.placement:
            placement = record.placement
            devices = f" ({', '.join(placement.devices)})" if placement.devices else ""
            out.print(
                f"[dim]{placement.strategy}-{placement.ranks} on "
                f"{', '.join(placement.nodes)}{devices}; "
                f"total {time.perf_counter() - started:.1f}s[/dim]"
            )
            if any(n.gpu for n in cluster.nodes) and "cpu" in placement.devices:
                out.print(
                    "[dim]its ranks share a GPU, so they computed on CPU (a ring needs a GPU "
                    "per rank; `ringq demo --ranks 1` runs on the GPU)[/dim]"
                )
    if record.error:
        sys.exit(1)


def demo_ranks(settings: Settings) -> int:
    """The demo's ranks where none are asked for: the GPUs it finds (one: single on it; more: a
    ring over them, up to 8), else a ring of 2 on the CPU."""
    gpus = local_gpus(settings)
    return min(len(gpus), 8) if gpus else 2


def local_gpus(settings: Settings) -> list[str]:
    """The GPUs local nodes run on: this machine's, unless RINGQ_BACKEND asks for the CPU."""
    return list(installed_gpus()) if settings.backend in ("auto", "cuda") else []


@click.command()
@click.option("--name", default=None, help="Node name (default: the host name).")
@click.option(
    "--address",
    default="127.0.0.1",
    show_default=True,
    help="Address this node's ranks listen on (reachable by the other nodes).",
)
@click.option("--memory-limit", type=float, default=None, help="GiB ringq may use on this node.")
@click.option(
    "--gpus",
    default=None,
    help="GPU indices this agent owns, e.g. 0 or 0,1 (one node per GPU, named NAME-gpuI when "
    "several). Default: every visible GPU when there is one, else CPU.",
)
@click.option(
    "--share-gpu",
    is_flag=True,
    help="Let other agents use this agent's GPU too (their groups then use MLX's ring backend).",
)
def node(
    name: str | None,
    address: str,
    memory_limit: float | None,
    gpus: str | None,
    share_gpu: bool,
) -> None:
    """Run a node agent: register, heartbeat, start rank processes when asked."""
    settings = get_settings()
    name = name or socket.gethostname()
    owned = parse_gpus(gpus)
    if len(owned) > 1:
        sys.exit(run_node_per_gpu(name, owned, sys.argv[1:]))
    if owned:
        os.environ["CUDA_VISIBLE_DEVICES"] = owned[0]
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    check_address(address)
    setup_service(settings)
    url = redis_url_for(settings)
    limit_gib = memory_limit or settings.node_memory_limit_gib
    agent = NodeAgent(
        name,
        connect(url, ride_out_s=SERVICE_RIDE_OUT_S),
        url,
        settings,
        address=address,
        memory_limit_bytes=int(limit_gib * 1024**3) if limit_gib else None,
        share_gpu=share_gpu,
    )
    agent.run()


def check_address(address: str) -> None:
    """Ranks listen on --address: one this machine does not have would only show up later, as
    a group whose ranks never join. Binding a throwaway socket (port 0) says so at start."""
    try:
        family, kind, _, _, sockaddr = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.bind(sockaddr)
    except OSError as exc:
        raise click.BadParameter(
            f"{address} is not an address of this machine ({exc.strerror or exc}): give one "
            "of its own that the other nodes reach",
            param_hint="'--address'",
        ) from None


def parse_gpus(value: str | None) -> list[str]:
    """GPU indices from --gpus, each checked against the machine's."""
    if value is None:
        return []
    wanted = [part.strip() for part in value.split(",") if part.strip()]
    installed = installed_gpus()
    missing = [gpu for gpu in wanted if gpu not in installed]
    if missing:
        have = ", ".join(installed) or "none"
        raise click.BadParameter(f"no GPU {', '.join(missing)} on this machine (it has: {have})")
    return wanted


def run_node_per_gpu(name: str, gpus: list[str], argv: list[str]) -> int:
    """`--gpus 0,1`: one node agent per GPU, as child processes; returns the first failure."""
    children = [
        subprocess.Popen([sys.executable, "-m", "cli.main", *child_argv(name, gpu, argv)])
        for gpu in gpus
    ]
    try:
        codes = [child.wait() for child in children]
    except KeyboardInterrupt:
        for child in children:
            child.send_signal(signal.SIGTERM)
        codes = [child.wait() for child in children]
    return next((code for code in codes if code), 0)


def child_argv(name: str, gpu: str, argv: list[str]) -> list[str]:
    """The `ringq node` arguments of the agent for one of several GPUs: the parent's, with
    its --name and --gpus (either form, `--gpus 0,1` or `--gpus=0,1`) replaced."""
    base = strip_option(strip_option(argv, "--gpus"), "--name")
    return [*base, "--name", f"{name}-gpu{gpu}", "--gpus", gpu]


def strip_option(argv: list[str], option: str) -> list[str]:
    """`argv` without `option` and its value, given as `option VALUE` or `option=VALUE`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def local_node_share_gib(nodes: int, gpu: str | None = None) -> str:
    """`ringq up`'s nodes share one machine (or one GPU): each may reserve an equal share of
    its memory."""
    total = psutil.virtual_memory().total
    if gpu is not None and (memory := cuda_memory_bytes(gpu)) is not None:
        total = memory[1]
    return f"{total / nodes / 1024**3:.2f}"


@click.command()
def dispatcher() -> None:
    """Run the dispatcher: admit, place and hand over submitted jobs."""
    settings = get_settings()
    setup_service(settings)
    serve(connect(redis_url_for(settings), ride_out_s=SERVICE_RIDE_OUT_S), settings)


def setup_service(settings: Settings) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if settings.parent_pid:
        exit_with_parent(settings.parent_pid)


def exit_with_parent(parent_pid: int) -> None:
    """Services started by `ringq up` stop (warm, via SIGTERM) if it dies without stopping them."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()
