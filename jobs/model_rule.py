"""The one rule for which models a job may name, kept by every entry point (the CLI, the Python
client, `/api/jobs`, chat, batch lines and batch metadata, through jobs.model_info.check_spec):
an alias (RINGQ_MODEL_ALIASES) is mapped first; then a built-in name, or a path inside
RINGQ_ALLOWED_DIRS. With that unset, the operator's own processes may name any path they can
read; `ringq serve` reads it as "no directory" (cli/http/app.py), so HTTP callers name built-in
models only. A refusal says neither whether the path exists nor where it resolves."""

from pathlib import Path

from jobs import random_models
from jobs.errors import ModelNotServedError, RingqError
from jobs.files import allowed_path
from jobs.settings import Settings

BUILT_IN_MODELS = ("smollm2",)  # jobs.model_catalog.PACKAGED_MODELS, without importing it


def is_built_in(name: str) -> bool:
    """A built-in name: a packaged model or a random preset (no file of the caller's)."""
    return name in BUILT_IN_MODELS or random_models.is_random(name)


def served_model(name: str, settings: Settings) -> str:
    """The model `name` runs as: its alias's target, checked to be built in or inside
    RINGQ_ALLOWED_DIRS (None: anywhere). ModelNotServedError otherwise."""
    target = settings.model_aliases.get(name, name)
    if is_built_in(target) or settings.allowed_dirs is None:
        return target
    try:
        allowed_path(Path(target).expanduser(), settings.allowed_dirs, "model")
    except (RingqError, OSError, ValueError, RuntimeError) as exc:  # NUL, ~user, symlink loop
        raise ModelNotServedError(name, reason=str(exc)) from None
    return target
