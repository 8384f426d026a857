"""Generated text: stop strings (a job's `stop`) and the partial answer of a cancelled job.

Every rank holds the same generated tokens (the sampling rank's token is shared each step), so
every rank decodes the same text and stops at the same step without another collective."""

from collections.abc import Callable, Sequence

from jobs.schemas import JobResult
from jobs.tokenizer import ChatTokenizer

TOKENS_PER_STOP_CHAR = 4  # a window this many tokens per stop character surely holds the match


def stop_check(
    tokenizer: ChatTokenizer, stops: Sequence[str]
) -> Callable[[list[int]], bool] | None:
    """A decode callback: whether the text ends with (or now contains) a stop string. Only the
    last few tokens are decoded each step, enough to hold the longest stop string."""
    if not stops:
        return None
    window = TOKENS_PER_STOP_CHAR * max(len(stop) for stop in stops) + 8
    eos = tokenizer.eos_token_ids

    def reached(tokens: list[int]) -> bool:
        text = tokenizer.decode([t for t in tokens[-window:] if t not in eos])
        return any(stop in text for stop in stops)

    return reached


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the first stop string (OpenAI's `stop`: not included)."""
    ends = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return text[: min(ends)] if ends else text


def partial_result(
    tokenizer: ChatTokenizer, tokens: list[int], prompt_tokens: int, stops: Sequence[str]
) -> JobResult | None:
    """What a job cancelled during decode had generated (None when it had not decoded)."""
    if not tokens:
        return None
    text = tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])
    return JobResult(
        text=cut_at_stop(text, stops),
        prompt_tokens=prompt_tokens,
        generated_tokens=len(tokens),
        prompt_tps=0.0,
        generation_tps=0.0,
        load_s=0.0,
        prefill_s=0.0,
        decode_s=0.0,
        peak_memory_bytes=[],
    )
