"""The memory a node agent registers (ring_worker/runtime/node_agent.py::node_memory_bytes, pure):
its
GPU's on CUDA nodes, host memory elsewhere, and a clear error naming the GPU where a CUDA node's
GPU cannot be read, instead of host memory reported as the GPU's."""

import pytest

from jobs.errors import RingqError
from ring_worker.runtime.node_agent import node_memory_bytes

GIB = 1024**3
HOST = (50 * GIB, 64 * GIB)
H200 = (140 * GIB, 143 * GIB)

MEMORY_TABLE = [
    # backend, gpu, GPU reading, expected
    ("cpu", None, None, HOST),
    ("metal", None, None, HOST),
    ("cpu", None, H200, HOST),
    ("cuda", "0", H200, H200),
    ("cuda", "3", H200, H200),
]


@pytest.mark.parametrize(("backend", "gpu", "reading", "expected"), MEMORY_TABLE)
def test_node_memory(backend, gpu, reading, expected):
    assert node_memory_bytes(backend, gpu, reading, HOST) == expected


def test_a_cuda_node_whose_gpu_cannot_be_read_names_the_gpu():
    with pytest.raises(RingqError, match=r"^GPU 3: its memory cannot be read \(nvidia-smi"):
        node_memory_bytes("cuda", "3", None, HOST)


def test_a_cuda_node_without_a_gpu_says_so():
    with pytest.raises(RingqError, match="RINGQ_BACKEND is cuda but this node sees no GPU"):
        node_memory_bytes("cuda", None, None, HOST)
