"""How many jobs a group decodes together (jobs/settings.py::group_batch_limit): from the
devices its plan gave it, as the dispatcher reads them, never from the device the rank finds."""

import pytest

from admission.estimate import Layout
from admission.group_plan import NodeFacts, plan_group
from jobs.schemas import GroupSpec
from jobs.settings import DEFAULT_MAX_BATCH, Settings, group_batch_limit

CPU = NodeFacts("c0", "cpu")
CPU1 = NodeFacts("c1", "cpu")
METAL = NodeFacts("m0", "metal")
GPU0 = NodeFacts("g0", "cuda", "hostA/0")
GPU1 = NodeFacts("g1", "cuda", "hostA/1")
GPU0_SHARED = NodeFacts("g2", "cuda", "hostA/0")


def group_on(nodes: list[NodeFacts], idle_s: float = 60.0) -> GroupSpec:
    layout = Layout("single") if len(nodes) == 1 else Layout("ring", len(nodes))
    plan = plan_group(layout, nodes, model_dtype="bfloat16", chunk_tokens=512)
    addresses = [f"127.0.0.1:{29500 + i}" for i in range(len(nodes))]
    return GroupSpec.from_plan(
        plan, group_id="g", job_id="j", model="m", addresses=addresses, idle_s=idle_s
    )


@pytest.mark.parametrize(
    ("nodes", "backend"),
    [
        ([CPU], "cpu"),
        ([CPU, CPU1], "cpu"),
        ([METAL], "metal"),
        ([GPU0], "cuda"),
        ([GPU0, GPU1], "cuda"),
        ([GPU0, GPU0_SHARED], "cpu"),  # ranks sharing a GPU compute on CPU (the plan says so)
        ([GPU0, CPU], "cpu"),
    ],
)
def test_the_plans_device_sets_the_batch_limit(nodes, backend):
    limit = group_batch_limit(group_on(nodes), Settings(max_batch=None))
    assert limit == DEFAULT_MAX_BATCH[backend]


def test_max_batch_overrides_and_a_group_that_is_not_kept_warm_decodes_alone():
    assert group_batch_limit(group_on([GPU0]), Settings(max_batch=3)) == 3
    assert group_batch_limit(group_on([GPU0], idle_s=0), Settings(max_batch=3)) == 1


def test_a_group_spec_without_devices_counts_as_cpu():
    group = group_on([GPU0]).model_copy(update={"devices": []})
    assert group_batch_limit(group, Settings(max_batch=None)) == DEFAULT_MAX_BATCH["cpu"]
