"""Pydantic messages that cross a process or live in Redis: job specs, progress, results, nodes,
ring groups. JSON only: nothing in Redis is ever unpickled."""

import re
import time
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from admission.vocabulary import Device, Exchange, KVLayout, Strategy, StrategyChoice, Transport
from jobs.lifecycle import JobState

if TYPE_CHECKING:
    from admission.group_plan import GroupPlan

JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # fullmatch: "$" would allow a "\n"
DEFAULT_GENERATE_PROMPT = "Summarise the document above in a few sentences."
# What a final job's spec.document reads: its record no longer holds the text (jobs/store.py)
DROPPED_DOCUMENT = "(the document left the record when the job ended)"
StopText = Annotated[str, Field(min_length=1, max_length=256)]


class JobKind(StrEnum):
    PREFILL = "prefill"
    GENERATE = "generate"


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class JobSpec(_Message):
    """What a user asks for. Validated at submit, before anything is enqueued."""

    kind: JobKind
    document: Annotated[str, Field(min_length=1)]
    document_name: str = "-"
    model: Annotated[str, Field(min_length=1)] = "smollm2"
    prompt: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=32768)] = 256
    temperature: Annotated[float, Field(ge=0.0, le=5.0)] = 0.0
    # ranks and strategy were ring_size and sharding: records and bodies with those still validate
    ranks: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        default="auto", validation_alias=AliasChoices("ranks", "ring_size")
    )
    strategy: StrategyChoice = Field(
        default="auto", validation_alias=AliasChoices("strategy", "sharding")
    )
    custom_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    keep_cache: bool = False  # prefill: keep the KV cache on its node for later generate jobs
    cache_from: str | None = None  # generate: start from this prefill job's kept KV cache
    stop: Annotated[list[StopText], Field(max_length=4)] = []  # generation ends at any of them
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None  # sampling seed (temperature > 0)

    @field_validator("document")
    @classmethod
    def _has_text(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the document is empty (only whitespace)")
        if "\x00" in value:
            raise ValueError("the document contains NUL bytes: is it a binary file?")
        return value

    @field_validator("document_name", "prompt")
    @classmethod
    def _is_unicode(cls, value: str | None) -> str | None:
        try:
            if value is not None:
                value.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: bytes that were not UTF-8
            raise ValueError(f"not valid Unicode text (a lone surrogate at {exc.start})") from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "JobSpec":
        if self.strategy == "single" and self.ranks not in ("auto", 1):
            raise ValueError(f"strategy 'single' runs on one node, but ranks={self.ranks}")
        if self.keep_cache and self.kind != JobKind.PREFILL:
            raise ValueError("keep_cache is for prefill jobs (generate jobs use cache_from)")
        if self.cache_from is not None and self.kind != JobKind.GENERATE:
            raise ValueError("cache_from is for generate jobs")
        if self.cache_from is not None:
            check_job_id(self.cache_from)
        if (self.keep_cache or self.cache_from) and (
            self.strategy not in ("auto", "single") or self.ranks not in ("auto", 1)
        ):
            raise ValueError("kept KV caches live on one node: use strategy 'single' (or auto)")
        return self

    def prompt_text(self) -> str:
        """The instruction after the document: a default when none is given, nothing for "" (a
        batch request whose one user message is the whole prompt)."""
        return DEFAULT_GENERATE_PROMPT if self.prompt is None else self.prompt


class Progress(_Message):
    phase: JobState
    processed: int = 0
    total: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0  # decode: generated tokens per second so far
    eta_s: float | None = None  # prefill: the seconds left as of updated_at, by the prompt's FLOPs
    updated_at: float = Field(default_factory=time.time)


class Placement(_Message):
    strategy: Strategy
    kv_layout: KVLayout = "replicated"
    ranks: int = Field(validation_alias=AliasChoices("ranks", "ring_size"))  # was ring_size
    nodes: list[str]
    group_id: str
    bytes_per_node: int
    job_bytes_per_node: int | None = None  # the job's own estimate; the rest: the memory tier's
    warm: bool = False  # ran on a group that was already loaded (a previous job's)
    reason: str | None = None  # why the dispatcher chose this layout (shown by `ringq status`)
    chunk_tokens: int | None = None  # the job's prefill chunk (admission.group_plan); None: 512
    devices: list[str] = []  # per rank, e.g. "cuda:host/1" or "cpu"


class JobResult(_Message):
    text: str | None = None
    prompt_tokens: int
    generated_tokens: int
    prompt_tps: float
    generation_tps: float
    load_s: float
    prefill_s: float
    decode_s: float
    peak_memory_bytes: list[int]
    prefill_started_at: float | None = None  # unix time; minus the job's created_at: its wait
    cached_tokens: int = 0  # prompt tokens taken from a kept KV cache (automatic or cache_from)
    cache_source: str | None = None  # where they came from, e.g. 'job 3f2a (single on n1)'
    batch_size: int = 1  # the most sequences it decoded together with (continuous batching)


class JobHeader(_Message):
    """A job's small fields: what every view of a job shows (a record, a list row, the API's
    view), each of them a separate field of the job's Redis hash."""

    id: str
    kind: JobKind
    state: JobState
    progress: Progress
    placement: Placement | None = None
    error: str | None = None
    waiting_reason: str | None = None  # queued until memory frees on the nodes: why
    attempt: int = 0  # placements tried after a lost group (at most RINGQ_MAX_RETRIES)
    created_at: float
    updated_at: float


def header_fields(view: type[JobHeader]) -> tuple[str, ...]:
    """The hash fields a view of a job reads: its own, less the id (the key holds it)."""
    return tuple(name for name in view.model_fields if name != "id")


class JobRecord(JobHeader):
    """Everything known about one job; `state` is the job's phase."""

    spec: JobSpec
    result: JobResult | None = None
    retry_reasons: list[str] = []  # why each earlier group was lost
    document_chars: int | None = None  # the document's length (None: a record from before)
    # final: the record no longer holds the document, and spec.document reads DROPPED_DOCUMENT
    document_dropped: bool = False


class BatchEntry(_Message):
    """One request of a batch; model and max_tokens are kept here so results need not read
    the job's spec (and with it the whole document)."""

    custom_id: str
    job_id: str
    model: str
    max_tokens: int


class SkippedLine(_Message):
    """An invalid batch line left out with --skip-invalid."""

    line_number: int
    custom_id: str | None = None
    message: str


class BatchRecord(_Message):
    """A batch as submitted: its jobs in input order."""

    id: str
    created_at: float
    input_name: str
    entries: list[BatchEntry]
    skipped_lines: int = 0  # invalid lines left out with --skip-invalid
    skipped: list[SkippedLine] = []  # those lines and why (written to the errors file)


class NodeInfo(_Message):
    name: str
    backend: Device
    memory_bytes: int  # what ringq may use on this node
    available_bytes: int  # free right now (min of the limit and what the OS reports)
    free_bytes: int | None = None  # what the OS (or the GPU) reports free, whatever the limit
    address: str  # where this node's ranks listen
    device: str = "cpu"  # what its ranks compute on, e.g. "cuda:1 NVIDIA H200" or "cpu"
    gpu: str | None = None  # the physical GPU it owns, "host/index"; None on CPU and Metal
    pid: int
    started_at: float
    heartbeat_at: float
    incarnation: str = (
        ""  # new at every start of the node's agent (ring_worker/runtime/node_ranks.py)
    )


class GroupSpec(_Message):
    """A group as the dispatcher planned it (admission.group_plan): each node agent starts one
    rank of it, and the ranks follow it without deciding anything again. Only group fields live
    here; a job's own (chunk tokens) are in its Placement."""

    group_id: str
    job_id: str  # the job it was started for
    model: str
    addresses: list[str]  # "host:port" per rank
    nodes: list[str]  # node name per rank
    strategy: Strategy = "ring"
    kv_layout: KVLayout = Field(
        default="replicated", validation_alias=AliasChoices("kv_layout", "decode_kv")
    )
    exchange: Exchange = "rotate"  # how ring ranks share K/V blocks
    transport: Transport = "ring"  # the mx.distributed backend the ranks join
    devices: list[str] = []  # per rank, e.g. "cuda:host/1" or "cpu"
    compute_dtype: str | None = None  # None: float32 on CPU, the model's dtype elsewhere
    idle_s: float = 0.0  # after its job, the group waits this long for another (warm groups)

    @property
    def ranks(self) -> int:
        return len(self.nodes)

    @property
    def backend(self) -> str:
        """What the plan computes on: its first rank's device kind (cpu, cuda, metal); a group
        whose ranks share a GPU computes on CPU (admission/group_plan.py)."""
        return (self.devices or ["cpu"])[0].split(":")[0]

    @classmethod
    def from_plan(
        cls,
        plan: "GroupPlan",
        *,
        group_id: str,
        job_id: str,
        model: str,
        addresses: list[str],
        idle_s: float = 0.0,
    ) -> "GroupSpec":
        """The group fields of a plan (admission.group_plan); the job's own stay out."""
        return cls(
            group_id=group_id,
            job_id=job_id,
            model=model,
            addresses=addresses,
            nodes=list(plan.nodes),
            strategy=plan.layout.strategy,
            kv_layout=plan.layout.kv_layout,
            exchange=plan.exchange,
            transport=plan.transport,
            devices=list(plan.devices),
            compute_dtype=plan.compute_dtype,
            idle_s=idle_s,
        )


def check_job_id(job_id: str) -> str:
    if not JOB_ID_PATTERN.fullmatch(job_id):
        raise ValueError(
            f"invalid job id {job_id!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return job_id


class TrackedGroup(_Message):
    """A running group in keys.GROUPS_INDEX, from admission on (jobs/recovery.py watches it)."""

    group: GroupSpec
    admitted_at: float  # unix s: the reconciler gives its ranks a lease's time to start


class WarmGroup(_Message):
    """A loaded group in keys.WARM_GROUPS that may take the next job (jobs/warm_groups.py)."""

    group: GroupSpec
    bytes_per_node: int  # what it holds reserved on each of its nodes
    chunk_tokens: int | None = None  # its jobs' prefill chunk (a job that joins it uses it too)


class GroupFailure(_Message):
    """Why a group failed, at keys.group_failed: the first report wins."""

    reason: str
    retry: bool  # False for errors a new placement cannot fix (an unusable model, a bad job)


class NodeRank(_Message):
    """A rank a node agent started and has not seen exit, at keys.node_ranks: an agent of the
    same node started later reports those of an earlier incarnation lost."""

    group: GroupSpec
    rank: int
    incarnation: str  # the starting agent's (NodeInfo.incarnation)
    pid: int
    started_at: float  # the process's start (unix s, as psutil reads it); 0.0: unknown
