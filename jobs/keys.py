"""Every Redis key and RQ queue name ringq uses, in one place."""

PREFIX = "ringq"

ADMIT_QUEUE = f"{PREFIX}:admit"  # RQ queue the dispatcher works on
JOBS_INDEX = f"{PREFIX}:jobs"  # sorted set: job id -> created_at
NODES_INDEX = f"{PREFIX}:nodes"  # set of node names ever registered
BATCHES_INDEX = f"{PREFIX}:batches"  # sorted set: batch id -> created_at
STATE_INDEXES_READY = f"{PREFIX}:jobs:by-state:ready"  # set once jobs from before are indexed


def job(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}"  # hash: spec, state, progress, placement, result, error, ...


def jobs_in_state(state: str) -> str:
    return f"{PREFIX}:jobs:by-state:{state}"  # sorted set: job id -> created_at, kept with state


def job_tokens(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:tokens"  # JSON list of prompt token ids


def job_cancel(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:cancel"  # set when cancel is asked; the job's ranks poll it


def job_checkpoints(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:checkpoints"  # hash: rank -> JSON CheckpointMark (its node)


def job_text(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:text"  # stream: generated text deltas (jobs/job_text.py)


def batch(batch_id: str) -> str:
    return f"{PREFIX}:batch:{batch_id}"  # JSON BatchRecord: its jobs in input order


def batch_feed(batch_id: str) -> str:
    # hash: total, enqueued (lines 0..enqueued-1 have jobs), window, stopped (the JobState the
    # lines not enqueued end in), reason; only for batches fed in a window (jobs/batch_feed.py)
    return f"{PREFIX}:batch:{batch_id}:feed"


BATCH_FEEDS = f"{PREFIX}:batch-feeds"  # set: ids of batches with lines still to enqueue


def node(name: str) -> str:
    return f"{PREFIX}:node:{name}"  # JSON NodeInfo, expires unless the agent heartbeats


def node_queue(name: str) -> str:
    return f"{PREFIX}:node:{name}:commands"  # RQ queue the node agent works on


def ports(address: str) -> str:
    return f"{PREFIX}:ports:{address}"  # counter for rank port allocation on one address


def group_failed(group_id: str) -> str:
    return f"{PREFIX}:group:{group_id}:failed"  # JSON GroupFailure; agents then kill its ranks


def group_idle(group_id: str) -> str:
    return f"{PREFIX}:group:{group_id}:idle"  # exists while a warm group's rank 0 waits for a job


def group_next(group_id: str, rank: int) -> str:
    return f"{PREFIX}:group:{group_id}:next:{rank}"  # list: job ids for a warm group's rank


def group_batch(group_id: str) -> str:
    # hash: job id -> bytes its joining added to the group's reservation, for the jobs a warm
    # group runs now (its batch); the reconciler retries all of them when the group is lost
    return f"{PREFIX}:group:{group_id}:batch"


def group_batch_buffer(group_id: str) -> str:
    # hash: slots, tokens, bytes: the KV buffer a warm group's decode batch grows to (rows and
    # positions per row, as ring_worker/engine/batch_cache.py allocates them) and the bytes its
    # joins
    # added to the group's reservation for it; kept while the batch has a job
    return f"{PREFIX}:group:{group_id}:batch-buffer"


def node_reserved(name: str) -> str:
    return f"{PREFIX}:node:{name}:reserved"  # hash: group id -> bytes reserved on this node


def node_leases(name: str) -> str:
    return f"{PREFIX}:node:{name}:leases"  # sorted set: group id -> lease expiry (unix s)


def memory_hold(job_id: str) -> str:
    # hash: node -> bytes a job waiting for memory waits for there (held while it is the
    # oldest: jobs/memory_waits.py); expires unless the job waits again
    return f"{PREFIX}:job:{job_id}:memory-hold"


def node_ranks(name: str) -> str:
    return f"{PREFIX}:node:{name}:ranks"  # hash: "group id:rank" -> JSON NodeRank, while it runs


def admit_retries(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:admit-retries"  # counter: RQ ids of re-enqueued admissions


GROUPS_INDEX = f"{PREFIX}:groups"  # hash: group id -> JSON TrackedGroup while it runs
WARM_GROUPS = f"{PREFIX}:warm"  # hash: group id -> JSON WarmGroup while it may take jobs
MEMORY_WAITS = f"{PREFIX}:memory-waits"  # sorted set: job id -> created_at, while it waits
ADMIT_WAKE = f"{PREFIX}:admit-wake"  # list of one word: memory or a group slot may have freed
SERVICES = f"{PREFIX}:services"  # hash: service label -> JSON ServiceStatus (`ringq up` writes)


def script_call(token: str) -> str:
    return f"{PREFIX}:once:{token}"  # a once-script call's answer (jobs/once.py; expires)


def gpu_owner(host: str, gpu: str) -> str:
    return f"{PREFIX}:gpu:{host}:{gpu}"  # the node agent that owns this GPU (expires with it)


# `ringq serve`'s OpenAI-compatible Files and Batches (cli/http/).
FILES_INDEX = f"{PREFIX}:files"  # sorted set: file id -> created_at
OPENAI_BATCHES_INDEX = f"{PREFIX}:openai-batches"  # sorted set: batch id -> created_at


def file_meta(file_id: str) -> str:
    return f"{PREFIX}:file:{file_id}"  # JSON: id, filename, purpose, bytes, created_at


def file_content(file_id: str) -> str:
    return f"{PREFIX}:file:{file_id}:content"  # no longer written: bytes live under RINGQ_HOME


def tenant_jobs(tenant: str) -> str:
    return f"{PREFIX}:tenant:{tenant}:jobs"  # sorted set: job id -> created_at, jobs it created


def tenant_batches(tenant: str) -> str:
    return f"{PREFIX}:tenant:{tenant}:batches"  # sorted set: batch id -> created_at


def openai_batch(batch_id: str) -> str:
    return f"{PREFIX}:openai-batch:{batch_id}"  # JSON: what OpenAI's batch object adds to ours


def openai_batch_finalizing(batch_id: str) -> str:
    return f"{PREFIX}:openai-batch:{batch_id}:finalizing"  # set while its files are written


# Automatic prefix reuse (jobs/prefix_cache.py, jobs/prefix_index.py)
PREFIX_ENTRIES = f"{PREFIX}:prefix:entries"  # sorted set: cache entry id -> last used (unix s)


def prefix_block(block_key: str) -> str:
    return f"{PREFIX}:prefix:block:{block_key}"  # set of cache entry ids holding this block chain


def prefix_entry(entry_id: str) -> str:
    return f"{PREFIX}:prefix:entry:{entry_id}"  # JSON CacheEntry: where its KV files are


def prefix_entry_tokens(entry_id: str) -> str:
    return f"{PREFIX}:prefix:entry:{entry_id}:tokens"  # JSON list of the entry's prompt tokens


def prefix_entry_shards(entry_id: str) -> str:
    return f"{PREFIX}:prefix:entry:{entry_id}:shards"  # hash: rank -> JSON CacheShard, while kept


def prefix_pending(block_key: str) -> str:
    return f"{PREFIX}:prefix:pending:{block_key}"  # job id prefilling this block chain right now
