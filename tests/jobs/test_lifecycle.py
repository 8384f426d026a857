import pytest

from jobs.lifecycle import FINAL_STATES, JobState, can_transition

S = JobState


@pytest.mark.parametrize(
    ("old", "new", "legal"),
    [
        (S.QUEUED, S.ADMITTED, True),
        (S.QUEUED, S.PREFILL, False),
        (S.ADMITTED, S.LOADING, True),
        (S.ADMITTED, S.QUEUED, True),  # requeue after a lost group
        (S.LOADING, S.PREFILL, True),
        (S.PREFILL, S.DECODE, True),
        (S.PREFILL, S.FINISHED, True),  # prefill jobs end after prefill
        (S.DECODE, S.FINISHED, True),
        (S.DECODE, S.PREFILL, False),
        (S.PREFILL, S.QUEUED, True),  # retry after a lost group
        (S.DECODE, S.ADMITTED, False),
        (S.LOADING, S.FAILED, True),
        (S.QUEUED, S.CANCELLED, True),
        (S.FINISHED, S.FAILED, False),
        (S.FAILED, S.QUEUED, False),
        (S.CANCELLED, S.ADMITTED, False),
    ],
)
def test_transitions(old, new, legal):
    assert can_transition(old, new) is legal


@pytest.mark.parametrize("final", sorted(FINAL_STATES))
def test_final_states_never_change(final):
    assert not any(can_transition(final, new) for new in JobState)
