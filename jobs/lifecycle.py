"""Job states and the one rule that says which changes are legal."""

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    LOADING = "loading"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in FINAL_STATES


FINAL_STATES = frozenset({JobState.FINISHED, JobState.FAILED, JobState.CANCELLED})

_NEXT: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.ADMITTED}),
    JobState.ADMITTED: frozenset({JobState.LOADING, JobState.QUEUED}),
    JobState.LOADING: frozenset({JobState.PREFILL, JobState.QUEUED}),
    JobState.PREFILL: frozenset({JobState.DECODE, JobState.FINISHED, JobState.QUEUED}),
    JobState.DECODE: frozenset({JobState.FINISHED, JobState.QUEUED}),
}


def can_transition(old: JobState, new: JobState) -> bool:
    """Forward through the phases, or back to queued when its group was lost (a retry); any
    live job may fail or be cancelled; final states stay."""
    if old.is_final:
        return False
    if new in (JobState.FAILED, JobState.CANCELLED):
        return True
    return new in _NEXT.get(old, frozenset())
