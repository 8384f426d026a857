"""One base exception; subclasses say what kind of thing went wrong, messages say what to do."""


class RingqError(Exception):
    """Base for every error ringq raises on purpose."""


class InvalidJobError(RingqError):
    """A job spec or its input is unusable (bad file, bad number, prompt too long...);
    `param`: the request field to change, when one is (the HTTP API's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class BatchInputError(InvalidJobError):
    """Lines of a batch JSONL file are unusable; `line_errors` holds (line number, message)."""

    def __init__(self, message: str, line_errors: list[tuple[int, str]]):
        super().__init__(message)
        self.line_errors = line_errors


class UnknownModelError(RingqError):
    """The model name or path does not resolve to a model ringq can load."""


class ForbiddenPathError(RingqError):
    """A path outside RINGQ_ALLOWED_DIRS: services read files only from those directories."""


class AdmissionError(RingqError):
    """The job cannot be placed on the live nodes (needs more memory than they have)."""


class JobNotFoundError(RingqError):
    """No job with that id exists in Redis."""


class IllegalTransitionError(RingqError):
    """A job state change that the lifecycle does not allow."""


class RedisUnavailableError(RingqError):
    """Redis cannot be reached or started."""


class CorruptRecordError(RingqError):
    """A record in Redis is not what ringq wrote (not JSON, e.g. a planted pickle)."""


class StaleGroupError(RingqError):
    """A group wrote to a job that has moved on to another group (it was lost and retried)."""


class ModelLoadError(RingqError):
    """A rank could not load the job's model (missing or truncated weights...)."""


class JobFailedError(RingqError):
    """A job asked for its result ended failed or cancelled; `record` is its JobRecord."""

    def __init__(self, message: str, record: object):
        super().__init__(message)
        self.record = record


class JobNotFinishedError(RingqError):
    """A job asked for its result is still queued or running; `record` is its JobRecord."""

    def __init__(self, message: str, record: object):
        super().__init__(message)
        self.record = record


class ModelNotServedError(UnknownModelError):
    """A model name that is neither built in nor a model inside RINGQ_ALLOWED_DIRS. Its message
    says neither whether a path exists nor where it resolves (HTTP callers see it); `reason`
    holds what was found, for the operator's log and the CLI."""

    def __init__(self, model: str, reason: str = ""):
        super().__init__(
            f"model {model!r} is not served here: name a built-in model (smollm2, "
            "random:<preset>), "
            "a name mapped by RINGQ_MODEL_ALIASES, or a model inside RINGQ_ALLOWED_DIRS"
        )
        self.model = model
        self.reason = reason
