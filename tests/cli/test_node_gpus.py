"""`ringq node --gpus 0,1`: the arguments each per-GPU child agent is started with."""

import pytest

from cli.services import child_argv

CHILD_ARGV_TABLE = [
    # parent argv (after the program name), GPU, the child's argv
    (["node", "--gpus", "0,1"], "1", ["node", "--name", "h-gpu1", "--gpus", "1"]),
    (["node", "--gpus=0,1"], "0", ["node", "--name", "h-gpu0", "--gpus", "0"]),
    (
        ["node", "--gpus", "0,1", "--memory-limit", "1"],
        "0",
        ["node", "--memory-limit", "1", "--name", "h-gpu0", "--gpus", "0"],
    ),
    (
        ["node", "--memory-limit=1", "--gpus=0,1", "--share-gpu"],
        "1",
        ["node", "--memory-limit=1", "--share-gpu", "--name", "h-gpu1", "--gpus", "1"],
    ),
    (
        ["node", "--name", "old", "--gpus", "0,1", "--address", "10.0.0.1"],
        "1",
        ["node", "--address", "10.0.0.1", "--name", "h-gpu1", "--gpus", "1"],
    ),
    (["node", "--name=old", "--gpus", "0,1"], "0", ["node", "--name", "h-gpu0", "--gpus", "0"]),
]


@pytest.mark.parametrize(("argv", "gpu", "expected"), CHILD_ARGV_TABLE)
def test_child_argv(argv: list[str], gpu: str, expected: list[str]) -> None:
    assert child_argv("h", gpu, argv) == expected
