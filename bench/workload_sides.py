"""bench.workload's services: ringq through its Batch API, and mlx_lm.server driven as a user
drives it (the floor, ringq's engine in this process, is bench/workload_floor.py). A side that
fails is recorded in its part of the JSON, not raised: the other sides still run."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from openai.types.chat import ChatCompletionMessageParam

READY_S = 180.0  # services start and load in this long
FINAL_BATCH = ("completed", "failed", "cancelled", "expired")
REQUEST_TIMEOUT_S = 3600.0
RETRIES = 5  # the openai client's own retries of connection errors, 429 and 5xx
WARM_UP: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM (ringq up stops its children on it), SIGKILL to its session after `timeout_s`."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def wait_ready(url: str, process: subprocess.Popen, log: Path, key: str | None = None) -> None:
    """Until GET `url` answers 200; a process that exits first fails with its log's tail."""
    deadline = time.monotonic() + READY_S
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"{log.name}: exited with {process.returncode}: {log.read_text()[-2000:]}"
            )
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {READY_S:.0f} s: {log.read_text()[-2000:]}")


def wait_for_line(log: Path, text: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_S
    while text not in (log.read_text(errors="replace") if log.exists() else ""):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ringq up not ready: {log.read_text()[-2000:]}")
        time.sleep(0.2)


def failed(part: str) -> dict[str, Any]:
    print(f"{part} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    return {"error": traceback.format_exc(limit=3)}


# -- ringq ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ringq:
    base_url: str
    key: str
    redis_url: str
    home: Path
    cluster: str  # what `ringq up` says it started
    port_base: int


@contextmanager
def ringq_service(port_base: int, logs: Path | None) -> Iterator[Ringq]:
    """`ringq up` and `ringq serve` in a fresh RINGQ_HOME, every other RINGQ_* setting at its
    default (the ranks preload OpenBLAS themselves)."""
    from jobs.client import default_redis_url
    from jobs.settings import Settings

    home = Path(tempfile.mkdtemp(prefix="ringq-wl-", dir="/tmp"))  # short: a unix socket
    key = os.urandom(8).hex()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGQ_") and k != "LD_PRELOAD"}
    env.update(
        RINGQ_HOME=str(home), RINGQ_API_KEYS=key, RINGQ_RANK_PORT_BASE=str(port_base), COLUMNS="300"
    )  # its one-line banner on one line
    cli = [sys.executable, "-m", "cli.main"]
    up = spawn([*cli, "up"], env, home / "up.log")
    try:
        wait_for_line(home / "up.log", "ringq up: redis", up)
        port = free_port()
        serve_log = home / "serve.log"
        serve = spawn(
            [*cli, "serve", "--port", str(port), "--log-level", "warning"], env, serve_log
        )
        try:
            base_url = f"http://127.0.0.1:{port}/v1"
            wait_ready(f"{base_url}/models", serve, serve_log, key)
            redis_url = default_redis_url(Settings(home=home, redis_url=None))
            said = (home / "up.log").read_text(errors="replace")
            cluster = next(line for line in said.splitlines() if "ringq up: redis" in line)
            yield Ringq(base_url, key, redis_url, home, " ".join(cluster.split()), port_base)
        finally:
            stop(serve)
    finally:
        stop(up)
        if logs is not None and (home / "logs").exists():
            shutil.copytree(home / "logs", logs / "ringq", dirs_exist_ok=True)
            for log in (home / "up.log", home / "serve.log"):
                if log.exists():
                    shutil.copy(log, logs / "ringq" / log.name)
        shutil.rmtree(home, ignore_errors=True)


def run_ringq(requests: list, model: str, port_base: int, logs: Path | None) -> dict[str, Any]:
    try:
        with ringq_service(port_base, logs) as service:
            return submit_batch(service, requests, model)
    except Exception:
        return failed("ringq")


def submit_batch(service: Ringq, requests: list, model: str) -> dict[str, Any]:
    """One warm-up chat completion, then the whole workload as one batch, polled to its end."""
    from openai import OpenAI

    client = OpenAI(
        base_url=service.base_url,
        api_key=service.key,
        max_retries=RETRIES,
        timeout=REQUEST_TIMEOUT_S,
    )
    began = time.perf_counter()
    client.chat.completions.create(model=model, messages=WARM_UP, max_tokens=4, temperature=0)
    warm_up_s = time.perf_counter() - began
    lines = "".join(json.dumps(r.batch_line(model)) + "\n" for r in requests).encode()
    uploaded = client.files.create(file=("workload.jsonl", lines), purpose="batch")
    created_at = time.time()
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"model": model},
    )
    while batch.status not in FINAL_BATCH:
        time.sleep(0.25)
        batch = client.batches.retrieve(batch.id)
    polled_s = time.time() - created_at
    outputs = read_lines(client, batch.output_file_id) + read_lines(client, batch.error_file_id)
    rows = job_rows(service, batch.id, requests, created_at, outputs)
    ends = [row["finished_s"] for row in rows.values() if row.get("finished_s") is not None]
    return {
        "makespan_s": max(ends) if len(ends) == len(requests) else None,
        "makespan_polled_s": polled_s,
        "status": batch.status,
        "batch_errors": batch.errors.model_dump() if batch.errors else None,
        "warm_up_s": warm_up_s,
        "settings": {
            "RINGQ_*": "defaults",
            "RINGQ_RANK_PORT_BASE": service.port_base,
            "cluster": service.cluster,
        },
        "driven": "openai client: files.create, batches.create, batches.retrieve every 0.25 s; "
        "one warm-up chat completion first",
        "requests": rows,
    }


def read_lines(client: Any, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line]


def job_rows(
    service: Ringq, batch_id: str, requests: list, created_at: float, outputs: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per request: its output line's usage and text, and its job record's times (a batch's
    job ids are `{batch id}-{line number}`)."""
    from jobs.redis_server import connect
    from jobs.store import JobStore

    store = JobStore(connect(service.redis_url))
    by_id = {line["custom_id"]: line for line in outputs}
    rows = {}
    for number, request in enumerate(requests, start=1):
        line = by_id.get(request.custom_id, {})
        body = (line.get("response") or {}).get("body") or {}
        usage = body.get("usage") or {}
        record = store.get(f"{batch_id}-{number}")
        result = record.result
        rows[request.custom_id] = {
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "text": body["choices"][0]["message"]["content"] if body else None,
            "error": line.get("error"),
            "state": record.state.value,
            "finished_s": record.updated_at - created_at if result else None,
            "enqueued_s": record.created_at - created_at,
            "wait_s": (result.prefill_started_at or record.created_at) - record.created_at
            if result
            else None,
            "prefill_s": result.prefill_s if result else None,
            "decode_s": result.decode_s if result else None,
            "batch_size": result.batch_size if result else None,
            "load_s": result.load_s if result else None,
            "cache_source": result.cache_source if result else None,
            "placement": placement_label(record.placement),
        }
    return rows


def placement_label(placement: Any) -> str | None:
    """'ring-2 (new group)', 'single-1 (warm group)'."""
    if placement is None:
        return None
    group = "warm group" if placement.warm else "new group"
    return f"{placement.strategy}-{placement.ranks} ({group})"


# -- mlx_lm.server -------------------------------------------------------------------------


def export_model(model: str, path: Path) -> None:
    """What a rank computes with (ring_worker.engine.models.load_for_this_device: on CPU the
    GGUF dequantized to float32, a random model from its seed) as an mlx-lm model dir; its
    tokenizer and chat template are ringq's own. Run in a child process: the weights leave
    this one's device memory with it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from jobs.model_catalog import model_config, resolve_model
    from jobs.tokenizer import load_tokenizer
    from ring_worker.engine.models import load_for_this_device

    source = resolve_model(model, allowed_dirs=None)
    loaded, tokenizer = load_for_this_device(source), load_tokenizer(source)
    weights = dict(tree_flatten(loaded.parameters()))
    if any(name.endswith(".scales") for name in weights):
        raise ValueError(f"{model}: quantized weights; write their quantization config first")
    if any(type(layer.self_attn.rope).__name__ == "_FactorRoPE" for layer in loaded.layers):
        raise ValueError(f"{model}: GGUF rope factors have no mlx-lm config")
    config = model_config(source)
    config["torch_dtype"] = str(next(iter(weights.values())).dtype).removeprefix("mlx.core.")
    if tokenizer.eos_token_ids:
        config["eos_token_id"] = sorted(tokenizer.eos_token_ids)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.hf.save_pretrained(path)


def run_peer(
    requests: list,
    model: str,
    grid: list,
    logs: Path | None,
    on_try: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every setting of `grid` in turn on the exported weights; the best is the fastest try that
    answered every request. `on_try`: given the summary so far after each try (a run cut short
    keeps the tries it finished)."""
    from ring_worker.runtime.processes import rank_environment

    folder = Path(tempfile.mkdtemp(prefix="ringq-wl-peer-"))
    tries: list[dict[str, Any]] = []
    try:
        began = time.perf_counter()
        code = (
            f"from bench.workload_sides import export_model; export_model({model!r}, "
            f"__import__('pathlib').Path({str(folder / 'model')!r}))"
        )
        subprocess.run([sys.executable, "-c", code], env=rank_environment(), check=True)
        export_s = time.perf_counter() - began
        for settings in grid:
            tries.append(peer_try(folder, requests, settings, logs))
            if on_try is not None and len(tries) < len(grid):
                on_try(peer_summary(tries, export_s))
    except Exception:
        return failed("mlx_lm.server")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return peer_summary(tries, export_s)


def peer_summary(tries: list[dict[str, Any]], export_s: float) -> dict[str, Any]:
    complete = [t for t in tries if t.get("makespan_s") and not t.get("errors")]
    best = min(complete, key=lambda t: t["makespan_s"]) if complete else None
    return {
        "makespan_s": best["makespan_s"] if best else None,
        "settings": best["settings"] if best else None,
        "best": best,
        "tries": [{k: v for k, v in t.items() if k != "requests"} for t in tries],
        "export_s": export_s,
        "driven": f"openai client, a thread pool of decode_concurrency threads, requests in file "
        f"order, max_retries={RETRIES}; questions: chat.completions, prefills: "
        f"completions with max_tokens=1; one warm-up request first",
    }


def peer_try(folder: Path, requests: list, settings: Any, logs: Path | None) -> dict[str, Any]:
    from openai import OpenAI

    from ring_worker.runtime.processes import rank_environment

    port, log = free_port(), (logs or folder) / f"mlx-lm-server-{port_label(settings)}.log"
    argv = [
        sys.executable,
        "-m",
        "mlx_lm.server",
        "--model",
        str(folder / "model"),
        "--port",
        str(port),
        *settings.flags(),
    ]
    server = spawn(argv, rank_environment(), log)
    found: dict[str, Any] = {"settings": asdict(settings)}
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", server, log)
        client = OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key="none",
            max_retries=RETRIES,
            timeout=REQUEST_TIMEOUT_S,
        )
        began = time.perf_counter()
        client.chat.completions.create(
            model="default_model", messages=WARM_UP, max_tokens=4, temperature=0
        )
        found["warm_up_s"] = time.perf_counter() - began
        started = time.perf_counter()
        with ThreadPoolExecutor(settings.decode_concurrency) as pool:
            answers = list(pool.map(lambda r: ask(client, r, started, server), requests))
        rows = {r.custom_id: a for r, a in zip(requests, answers, strict=True)}
        found["errors"] = {i: a["error"] for i, a in rows.items() if a.get("error")}
        found["makespan_s"] = max(a["finished_s"] for a in answers)
        found["requests"] = rows
        found["server_exit"] = server.poll()  # None: it was still running
    except Exception:
        found.update(failed(f"mlx_lm.server {settings}"))
    finally:
        stop(server)
    print(f"mlx_lm.server {settings}: {found.get('makespan_s')}", file=sys.stderr, flush=True)
    return found


def port_label(settings: Any) -> str:
    return "-".join(str(v) for v in asdict(settings).values() if v is not None)


def ask(client: Any, request: Any, started: float, server: subprocess.Popen) -> dict[str, Any]:
    """One request as a user sends it; the time it was sent and answered since `started`. None is
    sent once the server has exited (out of memory, say): its retries would only wait."""
    sent = time.perf_counter() - started
    if server.poll() is not None:
        return {"sent_s": sent, "finished_s": sent, "error": f"server exited ({server.returncode})"}
    try:
        if request.kind == "prefill":
            reply = client.completions.create(
                model="default_model", prompt=request.text, max_tokens=1, temperature=0
            )
            text = None
        else:
            message: ChatCompletionMessageParam = {"role": "user", "content": request.text}
            reply = client.chat.completions.create(
                model="default_model",
                messages=[message],
                max_tokens=request.max_tokens,
                temperature=0,
            )
            text = reply.choices[0].message.content
    except Exception as exc:  # recorded per request; the try goes on
        return {"sent_s": sent, "finished_s": time.perf_counter() - started, "error": repr(exc)}
    usage = reply.usage
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "sent_s": sent,
        "finished_s": time.perf_counter() - started,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
        "completion_tokens": usage.completion_tokens if usage else None,
        "text": text,
    }


# -- the floor -----------------------------------------------------------------------------


def engine_floor(requests: list, tokens: dict[str, list[int]], model: str) -> dict[str, Any]:
    """The floor in a process of its own, as a rank runs: the device memory it held (its MLX
    cache, an out-of-memory's leftovers) goes back before the peer loads."""
    from ring_worker.runtime.processes import rank_environment

    folder = Path(tempfile.mkdtemp(prefix="ringq-wl-floor-"))
    work, out = folder / "work.json", folder / "floor.json"
    try:
        rows = [asdict(r) for r in requests]
        work.write_text(json.dumps({"requests": rows, "tokens": tokens, "model": model}))
        code = f"from bench.workload_floor import main; main({str(work)!r}, {str(out)!r})"
        ran = subprocess.run(
            [sys.executable, "-c", code], env=rank_environment(), capture_output=True, text=True
        )
        print(ran.stderr, file=sys.stderr, flush=True)
        if ran.returncode != 0:
            return {"error": f"exit {ran.returncode}: {ran.stderr[-3000:]}"}
        return dict(json.loads(out.read_text()))
    except Exception:
        return failed("engine floor")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
