"""A job's generated text while it decodes: a Redis stream of deltas the lead rank appends to
(ring_worker/runtime/text_stream.py) and readers follow (`ringq serve`'s chat stream).

Each entry is {group, offset, text}, `offset` being where `text` starts in that attempt's text. A
reader takes from each entry only what lies beyond what it has sent, so a retried attempt repeats
nothing, and entries trimmed by the MAXLEN cap show as a gap that the job's result fills. The
stream expires with the job's record, or TEXT_KEEP_AFTER_END_S after the job ends if sooner.
Entries are plain strings, checked by a pydantic model."""

import time
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jobs import keys

TEXT_STREAM_MAXLEN = 4096  # entries kept per job (approximate trim); a flush every ~50 ms
TEXT_KEEP_AFTER_END_S = 3600  # the text is in the job's result too: do not keep it twice for long


class TextDelta(BaseModel):
    model_config = ConfigDict(frozen=True)

    group: str
    offset: int = Field(ge=0)
    text: str


def append_text(
    conn: redis.Redis, job_id: str, delta: TextDelta, expire_at_ms: int | None = None
) -> None:
    """Append one delta; `expire_at_ms` (unix ms) is when the stream goes, the job's own expiry
    (expire_at_job)."""
    key = keys.job_text(job_id)
    with conn.pipeline(transaction=False) as pipe:
        fields: dict[Any, Any] = {"group": delta.group, "offset": delta.offset, "text": delta.text}
        pipe.xadd(key, fields, maxlen=TEXT_STREAM_MAXLEN, approximate=True)
        if expire_at_ms is not None:
            pipe.pexpireat(key, expire_at_ms)
        pipe.execute()


def expire_at_job(conn: redis.Redis, job_id: str, default_ttl_s: int) -> int:
    """When the job's record expires (unix ms); `default_ttl_s` from now if it has no expiry."""
    ttl_ms: Any = conn.pttl(keys.job(job_id))
    if ttl_ms <= 0:
        ttl_ms = default_ttl_s * 1000
    return int(time.time() * 1000) + ttl_ms


def end_text(conn: redis.Redis, job_id: str) -> None:
    """The job ended: its stream goes TEXT_KEEP_AFTER_END_S from now, or with its record."""
    key = keys.job_text(job_id)
    ttl_ms: Any = conn.pttl(key)
    if ttl_ms == -2:  # no stream: the job generated no text (or did not stream it)
        return
    keep_ms = TEXT_KEEP_AFTER_END_S * 1000
    if ttl_ms < 0 or ttl_ms > keep_ms:
        conn.pexpire(key, keep_ms)


def read_text(
    conn: redis.Redis, job_id: str, after_id: str, block_ms: int | None = None
) -> tuple[list[TextDelta], str]:
    """The deltas after stream id `after_id` ("0": from the start), waiting up to `block_ms` for
    one (None: not at all), and the id to read after next. Malformed entries are skipped."""
    reply: Any = conn.xread({keys.job_text(job_id): after_id}, block=block_ms)
    deltas = []
    for _, entries in reply or []:
        for entry_id, fields in entries:
            after_id = _text(entry_id)
            delta = _parse(fields)
            if delta is not None:
                deltas.append(delta)
    return deltas, after_id


@dataclass
class TextFollower:
    """What a reader has sent of a job's text, and what each new delta adds to it."""

    sent: str = ""
    gap: bool = False  # an entry began beyond `sent`: the rest comes from the result

    def take(self, delta: TextDelta) -> str:
        """The part of `delta` not sent yet ("" if none, or once a gap was seen)."""
        if self.gap:
            return ""
        if delta.offset > len(self.sent):
            self.gap = True
            return ""
        new = delta.text[len(self.sent) - delta.offset :]
        self.sent += new
        return new

    def rest(self, final_text: str) -> str | None:
        """What is left to send of the job's final text; None if the sent text is not its start
        (an attempt that generated other text than the one streamed)."""
        if not final_text.startswith(self.sent):
            return None
        rest = final_text[len(self.sent) :]
        self.sent = final_text
        return rest


def _parse(fields: dict) -> TextDelta | None:
    try:
        return TextDelta.model_validate({_text(k): _text(v) for k, v in fields.items()})
    except (ValidationError, UnicodeDecodeError):
        return None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
