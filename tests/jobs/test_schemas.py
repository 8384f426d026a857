import pytest
from pydantic import ValidationError

from jobs.schemas import JobSpec, check_job_id


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


@pytest.mark.parametrize("job_id", ["a", "job-1", "A.b_c-9", "x" * 64])
def test_good_job_ids(job_id):
    assert check_job_id(job_id) == job_id


@pytest.mark.parametrize("job_id", ["", "-x", "a b", "x" * 65, "../etc", "a:b"])
def test_bad_job_ids(job_id):
    with pytest.raises(ValueError, match="invalid job id"):
        check_job_id(job_id)
