"""Which GPU each node and rank gets, decided without MLX (pure functions of what a machine
reports)."""

from pathlib import Path

import pytest

from ring_worker.engine import devices
from ring_worker.engine.devices import (
    LocalNode,
    local_nodes,
    node_backend,
    rank_device_environment,
    visible_gpus,
)


def test_cuda_visible_devices_is_split_one_per_rank(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_gpus() == ["2", "3"]
    assert rank_device_environment(0, "cuda") == {
        "CUDA_VISIBLE_DEVICES": "2",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "NCCL_NVLS_ENABLE": "0",
    }
    assert rank_device_environment(1, "cuda")["CUDA_VISIBLE_DEVICES"] == "3"
    assert rank_device_environment(2, "cuda")["CUDA_VISIBLE_DEVICES"] == "2"  # more ranks


def test_a_ranks_compiled_kernels_are_kept_under_ringq_home(monkeypatch, tmp_path):
    """One folder per MLX version and GPU model; a user's MLX_PTX_CACHE_DIR stands."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    monkeypatch.setattr(devices, "gpu_name", lambda index: "NVIDIA H100 80GB HBM3")
    kept = Path(rank_device_environment(0, "cuda", tmp_path)["MLX_PTX_CACHE_DIR"])
    assert kept.parent.parent == tmp_path / "kernels" and kept.name == "NVIDIA-H100-80GB-HBM3"
    assert kept.parent.name.startswith("mlx-0.")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "/elsewhere")
    assert "MLX_PTX_CACHE_DIR" not in rank_device_environment(0, "cuda", tmp_path)


@pytest.mark.parametrize("devices", ["", "-1"])
def test_no_visible_gpu_means_no_device_environment(monkeypatch, devices):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", devices)
    assert visible_gpus() == [] and rank_device_environment(0) == {}


def test_backend_can_be_forced(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert node_backend("cpu") == "cpu" and rank_device_environment(0, "cpu") == {}
    assert node_backend("cuda") == "cuda"


@pytest.mark.parametrize(
    ("gpus", "count", "expected"),
    [
        # no GPU: two CPU nodes by default, or as many as asked
        ([], None, [LocalNode("node-0"), LocalNode("node-1")]),
        ([], 3, [LocalNode("node-0"), LocalNode("node-1"), LocalNode("node-2")]),
        ([], 0, []),  # none: tests and multi-host set-ups start their own agents
        (["0"], 0, []),
        # one node per GPU, each pinned to its own
        (["0", "1"], None, [LocalNode("node-0", "0"), LocalNode("node-1", "1")]),
        (["0"], None, [LocalNode("node-0", "0")]),
        # fewer nodes than GPUs: the first ones
        (["0", "1", "2"], 2, [LocalNode("node-0", "0"), LocalNode("node-1", "1")]),
        # more nodes than GPUs: they take turns, and the ones that share say so
        (["0"], 2, [LocalNode("node-0", "0", True), LocalNode("node-1", "0", True)]),
        (
            ["0", "1"],
            3,
            [
                LocalNode("node-0", "0", True),
                LocalNode("node-1", "1"),
                LocalNode("node-2", "0", True),
            ],
        ),
    ],
)
def test_up_gives_every_gpu_its_own_node(gpus, count, expected):
    assert local_nodes(gpus, count) == expected
