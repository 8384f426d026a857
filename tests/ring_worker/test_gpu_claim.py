"""Two node agents on one GPU (ring_worker/runtime/node_agent.py::NodeAgent.claim_gpu), in a real
Redis:
the second gets a clear error at registration, a heartbeat never takes a GPU another agent
claimed after the first one's claim expired, and stopping frees only a claim that is still the
agent's. An agent whose GPU cannot be read stops at registration too. The GPU is forced the way
a pinned `ringq node --gpus 0` sees it: RINGQ_BACKEND=cuda and CUDA_VISIBLE_DEVICES=0 (claiming
is Redis only; no GPU is touched)."""

import pytest

from jobs import keys
from jobs.errors import RingqError
from jobs.settings import Settings
from ring_worker.engine.devices import cuda_memory_bytes
from ring_worker.runtime.node_agent import NodeAgent


@pytest.fixture
def agents(redis_conn, redis_url, short_tmp_path, monkeypatch) -> tuple[NodeAgent, NodeAgent]:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    settings = Settings(home=short_tmp_path, redis_url=None, backend="cuda", standby_rank="off")
    first, second = (NodeAgent(name, redis_conn, redis_url, settings) for name in ("a", "b"))
    assert (first.gpu, second.gpu) == ("0", "0")
    return first, second


def owner_of(agent: NodeAgent) -> object:
    assert agent.gpu is not None
    return agent.conn.get(keys.gpu_owner(agent.host, agent.gpu))


def test_a_second_agent_on_the_same_gpu_is_refused_by_name(agents):
    first, second = agents
    first.claim_gpu()
    with pytest.raises(RingqError, match=r"GPU 0 on .* already belongs to node a"):
        second.claim_gpu()
    assert owner_of(first) == b"a"
    first.claim_gpu()  # its own claim renews
    assert owner_of(first) == b"a"


def test_a_heartbeat_does_not_take_back_a_gpu_claimed_by_another_agent(agents, caplog):
    first, second = agents
    first.claim_gpu()
    first.conn.delete(keys.gpu_owner(first.host, "0"))  # its claim expired (agent stuck)
    second.claim_gpu()
    first.heartbeat()
    assert owner_of(first) == b"b"
    assert "node a: not registered: GPU 0 on" in caplog.text
    assert "already belongs to node b" in caplog.text
    assert first.store.live_nodes() == []
    first.release_gpu()  # a stopping agent frees only its own claim
    assert owner_of(first) == b"b"
    second.release_gpu()
    assert owner_of(first) is None


def test_an_agent_that_shares_its_gpu_claims_nothing(agents, redis_url, short_tmp_path):
    first, _ = agents
    first.claim_gpu()
    sharing = NodeAgent("c", first.conn, redis_url, first.settings, share_gpu=True)
    sharing.claim_gpu()
    assert owner_of(first) == b"a"


def test_an_agent_whose_gpu_cannot_be_read_stops_at_registration(agents):
    first, _ = agents
    if cuda_memory_bytes("0") is not None:
        pytest.skip("GPU 0 is readable here: the agent would register and serve")
    with pytest.raises(RingqError, match=r"^GPU 0: its memory cannot be read"):
        first.run()
    assert owner_of(first) is None  # its claim is given back
    assert first.store.live_nodes() == []
