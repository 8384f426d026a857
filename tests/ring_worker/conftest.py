import pytest

from tests.ring_worker.tiny import save_tiny


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_model_dir(request, tmp_path_factory):
    """A two-layer tiny Llama and Qwen3 on disk, per test module (a module may define its own)."""
    return save_tiny(tmp_path_factory.mktemp(request.param), request.param, layers=2)
