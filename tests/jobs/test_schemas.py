import pytest
from pydantic import ValidationError

from jobs.prefix_cache import CacheEntry
from jobs.schemas import JobSpec, Placement, check_job_id


def spec(**overrides):
    fields = {"kind": "generate", "document": "Some text.", "prompt": "Why?"}
    return JobSpec(**{**fields, **overrides})


def test_defaults():
    job = spec()
    assert job.model == "smollm2" and job.ranks == "auto" and job.temperature == 0.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"document": ""}, "at least 1 character"),
        ({"document": "  \n\t "}, "empty"),
        ({"document": "abc\x00def"}, "binary"),
        ({"max_tokens": 0}, "greater than or equal to 1"),
        ({"max_tokens": 10**9}, "less than or equal"),
        ({"temperature": -1}, "greater than or equal to 0"),
        ({"ranks": 0}, "ranks"),
        ({"ranks": "many"}, "ranks"),
        ({"kind": "train"}, "kind"),
        ({"strategy": "single", "ranks": 3}, "single"),
        ({"surprise": 1}, "Extra inputs"),
    ],
)
def test_invalid_specs_say_what_is_wrong(overrides, message):
    with pytest.raises(ValidationError, match=message):
        spec(**overrides)


def test_the_old_names_ring_size_and_sharding_still_validate_and_the_new_ones_are_written():
    old = JobSpec.model_validate(
        {"kind": "prefill", "document": "x", "ring_size": 2, "sharding": "pipeline"}
    )
    assert (old.ranks, old.strategy) == (2, "pipeline")
    written = old.model_dump(mode="json")
    assert (written["ranks"], written["strategy"]) == (2, "pipeline")
    assert not {"ring_size", "sharding"} & written.keys()
    assert JobSpec.model_validate_json(old.model_dump_json()) == old
    placement = Placement.model_validate(
        {
            "strategy": "ring",
            "ring_size": 2,
            "nodes": ["a", "b"],
            "group_id": "g",
            "bytes_per_node": 1,
        }
    )
    assert placement.ranks == 2 and "ring_size" not in placement.model_dump()
    entry = CacheEntry.model_validate(
        {"id": "j", "model_key": "random:tiny-llama", "tokens": 256, "layout": "ring",
         "ring_size": 2, "kv_dtype": "float32", "shards": [], "created_at": 0.0,
         "last_used_at": 0.0, "blocks": 1}
    )  # fmt: skip
    assert entry.ranks == 2 and "ring_size" not in entry.model_dump()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"sharding": "tree"},
            "sharding\n  Input should be 'auto', 'single', 'ring' or 'pipeline'",
        ),
        ({"ring_size": 0}, "ring_size"),
        ({"sharding": "single", "ring_size": 3}, "strategy 'single' runs on one node, but ranks=3"),
        ({"ranks": 2, "ring_size": 2}, "ring_size\n  Extra inputs are not permitted"),  # one name
    ],
)
def test_bad_values_under_the_old_names_say_what_is_wrong(fields, message):
    with pytest.raises(ValidationError, match=message):
        JobSpec.model_validate({"kind": "prefill", "document": "x", **fields})


@pytest.mark.parametrize("job_id", ["a", "job-1", "A.b_c-9", "x" * 64])
def test_good_job_ids(job_id):
    assert check_job_id(job_id) == job_id


@pytest.mark.parametrize("job_id", ["", "-x", "a b", "x" * 65, "../etc", "a:b"])
def test_bad_job_ids(job_id):
    with pytest.raises(ValueError, match="invalid job id"):
        check_job_id(job_id)
