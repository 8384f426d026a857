"""All ringq settings in one object, read from RINGQ_* environment variables."""

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from admission.vocabulary import Device, Exchange, KVLayout
from jobs.home import default_home

if TYPE_CHECKING:
    from jobs.schemas import GroupSpec


class Settings(BaseModel):
    """Each field is read from the environment variable of its name in capitals after
    `RINGQ_` (`max_batch`: `RINGQ_MAX_BATCH`); keyword arguments win over the environment.
    Values arrive as strings and pydantic converts them as it converts any input (lists and
    mappings have their own text forms, below). A plain model, not pydantic-settings: that
    package's import alone costs every CLI command ~50 ms."""

    model_config = ConfigDict(frozen=True)

    def __init__(self, **values: Any) -> None:
        super().__init__(**{**_environment(), **values})

    redis_url: str | None = Field(
        default=None, description="Use this Redis instead of starting the embedded one."
    )
    home: Path = Field(
        default_factory=default_home,
        description="Data dir for the embedded Redis, logs and rank scratch files.",
    )
    blas: str = Field(default="auto", description="'auto' preloads OpenBLAS on CPU nodes; 'off'.")
    default_model: str = "smollm2"
    prefill_chunk_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Force every job's prefill chunk; unset: 512 on CPU, on GPUs the largest up "
        "to 16384 that fits memory (admission/group_plan.py says why).",
    )
    exchange: Literal["auto", Exchange] = Field(
        default="auto",
        description="How ring ranks share K/V: auto = allgather on CUDA nodes (NCCL has no "
        "send/recv), rotate elsewhere.",
    )
    kv_layout: Literal["auto", KVLayout] = Field(
        default="auto",
        description="KV layout of ring groups: sharded keeps 1/N of the KV per rank (decode "
        "merges per-rank partial attention); replicated keeps all of it on every rank; auto: "
        "replicated where it fits, sharded where only that fits.",
    )
    ring_min_tokens: int = Field(
        default=1024, gt=0, description="Automatic placement runs shorter prompts on one node."
    )
    node_memory_limit_gib: float | None = Field(
        default=None,
        gt=0,
        description="Memory ringq may reserve on a node (`ringq node --memory-limit`); unset: "
        "all of it, or an equal share for each of `ringq up`'s local nodes.",
    )
    reservation_lease_s: float = Field(
        default=30.0,
        gt=0,
        description="A group's memory reservation expires unless its node agent renews it "
        "within this long (a crashed agent frees its nodes' memory).",
    )
    admit_retry_s: float = Field(
        default=1.0,
        gt=0,
        le=30,
        description="How often a job waiting for memory tries again (room that frees wakes "
        "the oldest at once). At most 30 s: a try pauses within its admission, which RQ stops "
        "after 60 s.",
    )
    node_heartbeat_s: float = Field(default=2.0, gt=0)
    node_ttl_s: float = Field(default=10.0, gt=0)
    rank_port_base: int = Field(default=29500, gt=1023, lt=65000)
    rank_port_span: int = Field(default=500, gt=0)
    max_document_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    job_ttl_s: int = Field(
        default=7 * 24 * 3600,
        gt=0,
        description="How long a job's record, tokens, flags and batch keys are kept.",
    )
    batch_window: int = Field(
        default=64,
        ge=1,
        description="Jobs of one `/v1/batches` batch unfinished in Redis at a time; `ringq "
        "serve` enqueues the next lines from its spool under RINGQ_HOME/batches as earlier "
        "ones end, so Redis holds at most this many of its documents. 64 is twice the decode "
        "batch of a CUDA group (RINGQ_MAX_BATCH's 32), so a warm group never waits for the "
        "feeder; raise it where more of one batch's jobs can run at once (several GPUs).",
    )
    node_max_groups: int = Field(
        default=1,
        gt=0,
        description="Groups that run at once on one machine's CPU nodes (they share its cores: "
        "a second group beside a running one only slows both); a GPU node runs one group per "
        "GPU, within its memory.",
    )
    stall_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="A rank with no progress (chunk, decode step) for this long dumps its threads "
        "and exits, failing the job.",
    )
    max_retries: int = Field(
        default=2,
        ge=0,
        description="How often a job whose group was lost (a rank or node died, a link broke, a "
        "stall) is placed again before it fails.",
    )
    group_idle_s: float = Field(
        default=60.0,
        ge=0,
        description="A group whose job finished stays loaded this long for the next job of the "
        "same model and layout (0: every job starts and loads a group of its own).",
    )
    max_batch: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="Generate jobs of one model and layout a warm group decodes together "
        "(continuous batching; 1: one job at a time); unset: the backend's default "
        "(DEFAULT_MAX_BATCH: 8 on CPU and Metal, 32 on CUDA).",
    )
    batch_profile_dir: Path | None = Field(
        default=None,
        description="Diagnostics: rank 0 of a batching group profiles each batch (cProfile, "
        "from its first job joining to its last leaving) and writes the top functions there.",
    )
    checkpoint_tokens: int = Field(
        default=2048,
        ge=0,
        description="Each rank saves the prefill KV added since its last checkpoint every this "
        "many prompt tokens (at a chunk boundary; GPU chunks are larger, so there every chunk) "
        "under RINGQ_HOME/checkpoints, so a retried job continues from there; 0: off. The "
        "prefill never waits for the disk (docs/checkpoints.md).",
    )
    checkpoint_after_s: float = Field(
        default=60.0,
        ge=0,
        description="Only a prefill projected (after its first chunk, by its FLOPs) to need at "
        "least this many seconds more takes checkpoints: a shorter one costs less to redo after "
        "a crash than to insure; 0: every prefill does.",
    )
    checkpoint_budget_bytes: int | None = Field(
        default=None,
        gt=0,
        description="Disk that the prefill checkpoints of a node's ranks may take (under "
        "RINGQ_HOME/checkpoints/<job>/<node>); past it they are skipped; unset: a segment is "
        "written while the disk keeps a tenth of its size free after it. Apart from "
        "RINGQ_CACHE_BYTES: ring_worker/engine/checkpoint.py says why.",
    )
    backend: Literal["auto", Device] = Field(
        default="auto",
        description="What a node computes on: auto = metal on macOS, cuda where NVIDIA GPUs are "
        "visible, else cpu.",
    )
    warm_up: bool = Field(
        default=True,
        description="GPU groups run their kernels once while loading (two chunks, two decode "
        "steps), so the first job does not pay for compilation.",
    )
    standby_rank: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="A node agent keeps one rank process started ahead (imports done, device "
        "context made), so a new group starts at once; auto: on GPU and Metal nodes.",
    )
    parent_pid: int | None = Field(
        default=None,
        description="Internal: the process that started this one (`ringq up` for its services, "
        "a node agent or `ringq run` for its ranks); they exit with it.",
    )
    rank_memory_limit_bytes: int | None = Field(
        default=None,
        description="Internal: a node agent sets it for its ranks (the node's memory budget), "
        "so ranks sharing a GPU stay within their shares.",
    )
    api_keys: str | None = Field(
        default=None,
        description="Bearer keys of `ringq serve`'s HTTP API, comma-separated; unset: no key "
        "needed, which `ringq serve` allows only on a loopback address.",
    )
    prefix_cache: Literal["on", "off"] = Field(
        default="on",
        description="Keep every job's prompt KV on its node and start later jobs that share "
        "its prefix from it (jobs/prefix_cache.py); off: compute every prompt whole.",
    )
    cache_bytes: int | None = Field(
        default=None,
        ge=0,
        description="Disk each node agent may fill with kept KV caches under RINGQ_HOME/caches "
        "(least recently used evicted first); unset: half of the disk space it could use (free "
        "space plus its own files) when a group opens the store.",
    )
    admin_keys: str | None = Field(
        default=None,
        description="Bearer keys of `ringq serve` that see every tenant's files, batches and "
        "jobs (comma-separated); each RINGQ_API_KEYS key sees only what it created.",
    )
    allowed_dirs: list[Path] | None = Field(
        default=None,
        description="Directories services may read models and batch documents from: a path "
        "list ('/models:/data', ':' or the platform's separator) or a JSON list; unset: any "
        "path the service user can read, and none for callers of `ringq serve`.",
    )
    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="Model names mapped to served models ('gpt-4o-mini=smollm2,gpt-4o=...' "
        "or a JSON object), so OpenAI batch files run unchanged.",
    )
    max_request_bytes: int = Field(
        default=32 * 1024 * 1024,
        gt=0,
        description="Largest HTTP request body `ringq serve` reads (uploads apart), refused "
        "with 413 while it streams in: twice RINGQ_MAX_DOCUMENT_BYTES leaves room for JSON "
        "escapes.",
    )
    max_upload_bytes: int = Field(
        default=200 * 1024 * 1024,
        gt=0,
        description="Largest file `POST /v1/files` takes (OpenAI's batch input limit), "
        "refused with 413 while it streams in.",
    )
    max_json_depth: int = Field(
        default=64, gt=0, le=400, description="Deepest JSON nesting a request body may have."
    )

    @field_validator("allowed_dirs", mode="before")
    @classmethod
    def _path_list(cls, value: Any) -> Any:
        """A JSON list, or paths joined by ':' (os.pathsep); blanks are dropped."""
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part for part in text.replace(os.pathsep, ":").split(":") if part.strip()]

    @field_validator("model_aliases", mode="before")
    @classmethod
    def _aliases(cls, value: Any) -> Any:
        """A JSON object, or 'name=model' pairs joined by commas."""
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("{"):
            return json.loads(text)
        pairs = [pair.split("=", 1) for pair in text.split(",") if pair.strip()]
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError("expected 'name=model' pairs joined by commas, or a JSON object")
        return {name.strip(): model.strip() for name, model in pairs}


# Variables still read under an earlier name, and the field each sets.
_OLD_NAMES = {"RINGQ_DECODE_KV": "kv_layout"}


def _environment() -> dict[str, str]:
    """The RINGQ_* variables that name a setting, keyed by the setting."""
    found = {field: os.environ[old] for old, field in _OLD_NAMES.items() if old in os.environ}
    for name in Settings.model_fields:
        value = os.environ.get(f"RINGQ_{name.upper()}")
        if value is not None:
            found[name] = value
    return found


# CPU: 8 rows decode 2.4x one at a time on a 2-core CPU (docs/batching.md); CUDA: 32 rows
# of the 8B shape on one H200 ran 584 tok/s (mlx-lm's BatchGenerator 3.5x one sequence at 64 and
# 2.9x at 32: most of the gain by 32, while a batch's KV and per-job latency grow with it).
DEFAULT_MAX_BATCH = {"cpu": 8, "metal": 8, "cuda": 32}


def max_batch_for(settings: Settings, backend: str) -> int:
    """The batch limit of a group on `backend` ("cpu", "metal", "cuda")."""
    return settings.max_batch or DEFAULT_MAX_BATCH.get(backend, 1)


def group_batch_limit(group: "GroupSpec", settings: Settings) -> int:
    """How many jobs a group may decode together, read the same way by the dispatcher (which
    offers a new group over 1 for jobs to join while it starts), the node agents and every rank:
    the backend of its first rank's device; 1 unless it is a warm group (idle_s > 0)."""
    return max_batch_for(settings, group.backend) if group.idle_s > 0 else 1


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
