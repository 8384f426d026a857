"""KV caches kept on a node: a prefill job with keep_cache saves its cache (mlx-lm's prompt-cache
format, safetensors) under RINGQ_HOME/caches; a generate job with cache_from loads it, keeps the
prefix its own prompt shares, and computes only the rest."""

from pathlib import Path
from typing import Any

from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache, trim_prompt_cache

from jobs.errors import InvalidJobError


def cache_path(home: Path, job_id: str) -> Path:
    return home / "caches" / f"{job_id}.safetensors"


def save_cache(home: Path, job_id: str, cache: list[Any], tokens: int) -> Path:
    path = cache_path(home, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_prompt_cache(str(path), cache, metadata={"job": job_id, "tokens": str(tokens)})
    return path


def shared_prefix(cached: list[int], tokens: list[int]) -> int:
    """Tokens the cache can stand for: the common prefix, less one so that at least the last
    prompt token is computed (its logits start the decode)."""
    same = 0
    for a, b in zip(cached, tokens, strict=False):
        if a != b:
            break
        same += 1
    return min(same, len(tokens) - 1)


def load_cache(
    home: Path, job_id: str, cached_tokens: list[int], tokens: list[int]
) -> tuple[list[Any], int]:
    """Job `job_id`'s cache trimmed to what `tokens` share with it, and how many tokens that is."""
    path = cache_path(home, job_id)
    if not path.is_file():
        raise InvalidJobError(f"cache_from: job {job_id}'s KV cache is not on this node ({path})")
    cache = load_prompt_cache(str(path))
    reuse = shared_prefix(cached_tokens, tokens)
    trim_prompt_cache(cache, len(cached_tokens) - reuse)
    return cache, reuse
