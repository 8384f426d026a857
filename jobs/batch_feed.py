"""Batches fed in a window: `ringq serve` keeps at most RINGQ_BATCH_WINDOW of a /v1/batches
batch's jobs unfinished in Redis, and enqueues the next lines as earlier ones end.

At creation the checked requests go to a spool file, RINGQ_HOME/batches/<batch id>.jsonl (0600,
one JobSpec JSON a line, in input order), and Redis gets the batch's record (every request, no
document) and its feed (jobs.batch.Feed; its window is the creating server's, kept by every
server). A feeder in each `ringq serve` process claims lines by advancing the feed's `enqueued`
in the transaction that writes their jobs, WATCHing the feed: two servers on one Redis and one
RINGQ_HOME never enqueue a line twice, and a server that stops loses none (the next continues
from `enqueued`). A cancel stops the feed (jobs.batch.stop_feed); the lines not enqueued then
end cancelled without a job. Once no line is left to enqueue, the spool is deleted.

So Redis holds the documents of at most the window's jobs of a batch (a final job's record drops
its document: jobs/store.py), and the rest wait on disk beside the uploaded files."""

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from jobs import keys
from jobs.batch import BatchRecord, get_batch, new_batch_record, parse_feed
from jobs.batch_input import BatchItem
from jobs.errors import InvalidJobError, JobNotFoundError
from jobs.lifecycle import JobState
from jobs.schemas import JobSpec
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import admit_data, admit_queue

log = logging.getLogger(__name__)
SPOOL_DIR = "batches"
# How often a feeder looks for room: a line waits at most this long after a job ends, while
# the window's other jobs keep the nodes busy. A poll reads the record and states of a
# 1,000-line batch in 13 ms (median, loaded 2-core CPU): 3 % of a core per such batch.
FEED_POLL_S = 0.5
LOST_REASON = (
    "the batch's spool file {path} is gone before this request was enqueued: servers that "
    "share a Redis must share RINGQ_HOME"
)


def spool_path(settings: Settings, batch_id: str) -> Path:
    return settings.home / SPOOL_DIR / f"{batch_id}.jsonl"


def start_feed(
    conn: redis.Redis,
    settings: Settings,
    items: Sequence[BatchItem],
    input_name: str,
    batch_id: str,
) -> BatchRecord:
    """Write the spool, then record the batch and its feed in one transaction; the feeders
    enqueue its lines from there."""
    record = new_batch_record(items, input_name, batch_id=batch_id)
    key = keys.batch(record.id)
    if conn.exists(key):
        raise InvalidJobError(f"a batch with id {record.id!r} already exists; choose another id")
    write_spool(spool_path(settings, record.id), [item.spec for item in items], settings.job_ttl_s)
    feed = keys.batch_feed(record.id)
    with conn.pipeline() as pipe:
        pipe.set(key, record.model_dump_json(), ex=settings.job_ttl_s)
        pipe.hset(
            feed, mapping={"total": len(items), "enqueued": 0, "window": settings.batch_window}
        )
        pipe.expire(feed, settings.job_ttl_s)
        pipe.zadd(keys.BATCHES_INDEX, {record.id: record.created_at})
        pipe.sadd(keys.BATCH_FEEDS, record.id)
        pipe.execute()
    return record


def write_spool(path: Path, specs: Sequence[JobSpec], ttl_s: int) -> None:
    """The specs as JSON lines at `path` (written aside, then renamed); spools older than the
    TTL, whose batches have expired, are deleted first."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    oldest = time.time() - ttl_s
    for old in path.parent.iterdir():
        try:
            if old.stat().st_mtime < oldest:
                old.unlink()
        except FileNotFoundError:
            continue
    partial = path.with_name(f".{path.name}.partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        for spec in specs:
            out.write(spec.model_dump_json().encode() + b"\n")
    partial.replace(path)


class BatchFeeder:
    """Feeds every batch with lines left (keys.BATCH_FEEDS); `run` in a thread of `ringq
    serve`. Any number of feeders may share a Redis: each claim is a transaction."""

    def __init__(self, conn: redis.Redis, settings: Settings):
        self.conn = conn
        self.settings = settings
        self.store = JobStore(conn, settings.job_ttl_s)
        self.wake = threading.Event()  # set: feed now, not at the next poll
        self._offsets: dict[str, list[int]] = {}  # batch id -> where each spool line starts

    def run(self, stop: threading.Event) -> None:
        """Feed until `stop` is set, every FEED_POLL_S or when woken."""
        while not stop.is_set():
            try:
                self.feed_all()
            except Exception:  # Redis restarting, a full disk: the next poll tries again
                log.exception("batch feeder: feeding failed; trying again")
            self.wake.wait(FEED_POLL_S)
            self.wake.clear()

    def feed_all(self) -> int:
        """Feed each batch once; returns the lines enqueued."""
        ids = sorted(_text(i) for i in self.conn.smembers(keys.BATCH_FEEDS))
        return sum(self.feed(batch_id) for batch_id in ids)

    def feed(self, batch_id: str) -> int:
        """Enqueue the batch's next lines while fewer than its window's jobs are unfinished;
        returns how many this call enqueued."""
        try:
            record = get_batch(self.conn, batch_id)
        except JobNotFoundError:
            self.retire(batch_id)
            return 0
        key = keys.batch_feed(batch_id)
        with self.conn.pipeline() as pipe:
            while True:
                try:
                    return self._claim(pipe, key, record)
                except redis.WatchError:  # another feeder or a cancel changed the feed
                    continue

    def _claim(self, pipe: redis.client.Pipeline, key: str, record: BatchRecord) -> int:
        pipe.watch(key)
        feed = parse_feed(pipe.hgetall(key))
        if feed is None or feed.done:
            pipe.unwatch()
            self.retire(record.id)
            return 0
        room = feed.window - self.unfinished(record, feed.enqueued)
        count = min(room, feed.total - feed.enqueued)
        if count <= 0:
            pipe.unwatch()
            return 0
        entries = record.entries[feed.enqueued : feed.enqueued + count]
        try:
            specs = self.read_spool(record.id, feed.enqueued, count)
        except FileNotFoundError:  # lost: a feeder deletes a spool only once the feed is done
            path = spool_path(self.settings, record.id)
            log.error("batch %s: its spool %s is gone; its other lines fail", record.id, path)
            pipe.multi()
            reason = LOST_REASON.format(path=path)
            pipe.hset(key, mapping={"stopped": JobState.FAILED.value, "reason": reason})
            pipe.execute()
            return 0
        pipe.multi()
        pipe.hincrby(key, "enqueued", count)
        jobs = [(entry.job_id, spec) for entry, spec in zip(entries, specs, strict=True)]
        self.store.create_in(pipe, jobs, time.time())
        admit = [admit_data(entry.job_id) for entry in entries]
        admit_queue(self.conn).enqueue_many(admit, pipeline=pipe)
        pipe.execute()
        log.debug("batch %s: enqueued %d lines from %d", record.id, count, feed.enqueued)
        if feed.enqueued + count == feed.total:
            self.retire(record.id)
        return count

    def unfinished(self, record: BatchRecord, enqueued: int) -> int:
        """The batch's enqueued jobs that are not final (an expired record counts as final).
        Read outside the WATCH: a job only leaves the count, so a stale read only waits."""
        with self.conn.pipeline(transaction=False) as pipe:
            for entry in record.entries[:enqueued]:
                pipe.hget(keys.job(entry.job_id), "state")
            states = pipe.execute()
        return sum(
            1 for raw in states if raw is not None and not JobState(json.loads(raw)).is_final
        )

    def read_spool(self, batch_id: str, start: int, count: int) -> list[JobSpec]:
        """Lines start..start+count-1 of the batch's spool."""
        path = spool_path(self.settings, batch_id)
        offsets = self._offsets.get(batch_id) or self._index(batch_id, path)
        with path.open("rb") as spool:
            spool.seek(offsets[start])
            return [JobSpec.model_validate_json(spool.readline()) for _ in range(count)]

    def _index(self, batch_id: str, path: Path) -> list[int]:
        offsets, position = [], 0
        with path.open("rb") as spool:
            for line in spool:
                offsets.append(position)
                position += len(line)
        self._offsets[batch_id] = offsets
        return offsets

    def retire(self, batch_id: str) -> None:
        """Forget a batch with no line left to enqueue, and delete its spool."""
        self.conn.srem(keys.BATCH_FEEDS, batch_id)
        spool_path(self.settings, batch_id).unlink(missing_ok=True)
        self._offsets.pop(batch_id, None)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
