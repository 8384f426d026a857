"""The whole transition matrix, written out: every (old, new) pair of the 8 states."""

import pytest

from jobs.lifecycle import FINAL_STATES, JobState, can_transition

S = JobState
COLUMNS = [S.QUEUED, S.ADMITTED, S.LOADING, S.PREFILL, S.DECODE, S.FINISHED, S.FAILED, S.CANCELLED]
# Row: from; column: to (in COLUMNS order). 1 = legal. Forward through the phases; back to
# queued when the group was lost (a retry, from admitted on); any live job may fail or be
# cancelled; a prefill job finishes after prefill; final states never change.
MATRIX = {
    #             que adm loa pre dec fin fai can
    S.QUEUED:    [0,  1,  0,  0,  0,  0,  1,  1],
    S.ADMITTED:  [1,  0,  1,  0,  0,  0,  1,  1],
    S.LOADING:   [1,  0,  0,  1,  0,  0,  1,  1],
    S.PREFILL:   [1,  0,  0,  0,  1,  1,  1,  1],
    S.DECODE:    [1,  0,  0,  0,  0,  1,  1,  1],
    S.FINISHED:  [0,  0,  0,  0,  0,  0,  0,  0],
    S.FAILED:    [0,  0,  0,  0,  0,  0,  0,  0],
    S.CANCELLED: [0,  0,  0,  0,  0,  0,  0,  0],
}  # fmt: skip


def test_the_matrix_covers_every_state():
    assert sorted(MATRIX) == sorted(JobState) and sorted(COLUMNS) == sorted(JobState)


@pytest.mark.parametrize("old", list(MATRIX))
def test_transitions_from(old):
    got = [int(can_transition(old, new)) for new in COLUMNS]
    assert got == MATRIX[old], f"from {old}: {dict(zip(COLUMNS, got, strict=True))}"


@pytest.mark.parametrize("final", sorted(FINAL_STATES))
def test_final_states_are_the_rows_of_zeros(final):
    assert final.is_final and not any(MATRIX[final])
    assert all(any(row) for state, row in MATRIX.items() if state not in FINAL_STATES)
