"""Which GPU each local rank gets, decided without MLX."""

import pytest

from ring_worker.devices import node_backend, rank_device_environment, visible_gpus


def test_cuda_visible_devices_is_split_one_per_rank(monkeypatch):
    monkeypatch.setenv("RINGQ_BACKEND", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_gpus() == ["2", "3"]
    assert rank_device_environment(0) == {"CUDA_VISIBLE_DEVICES": "2", "NCCL_NVLS_ENABLE": "0"}
    assert rank_device_environment(1)["CUDA_VISIBLE_DEVICES"] == "3"
    assert rank_device_environment(2)["CUDA_VISIBLE_DEVICES"] == "2"  # more ranks than GPUs


@pytest.mark.parametrize("devices", ["", "-1"])
def test_no_visible_gpu_means_no_device_environment(monkeypatch, devices):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", devices)
    monkeypatch.delenv("RINGQ_BACKEND", raising=False)
    assert visible_gpus() == [] and rank_device_environment(0) == {}


def test_backend_can_be_forced(monkeypatch):
    monkeypatch.setenv("RINGQ_BACKEND", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert node_backend() == "cpu" and rank_device_environment(0) == {}
