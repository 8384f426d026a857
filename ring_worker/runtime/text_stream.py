"""Generated text published while a sequence decodes, for `stream: true` chat completions.

The lead rank feeds each generated token to a TextStream, which detokenises incrementally with
mlx-lm's NaiveStreamingDetokenizer and publishes the new text through a callback once
FLUSH_INTERVAL_S has passed or FLUSH_TOKENS tokens have come, so decode does not wait on Redis
for every token. The naive detokenizer uses the model's own tokenizer, so the text is exactly
`tokenizer.decode` of the tokens, as the job's result is (mlx-lm's BPE and SPM detokenizers trim
a leading space); an incomplete UTF-8 character is held until its last byte comes. Text that may
start a stop string is held back until it does not, and nothing from a stop string on is ever
published. `close()` publishes the rest, ending exactly at the job's result text.

DecodeText wraps the engine's `stop_when` callback for single-sequence decode; a batched decode
loop makes one TextStream per sequence."""

import logging
import time
from collections.abc import Callable, Sequence

from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

from jobs.tokenizer import ChatTokenizer
from ring_worker.engine.decode_text import cut_at_stop, stop_check
from ring_worker.runtime.job_io import JobIO

log = logging.getLogger(__name__)
FLUSH_INTERVAL_S = 0.05
FLUSH_TOKENS = 16


class TextStream:
    """One sequence's text, published in deltas through `publish` as its tokens come."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        stops: Sequence[str],
        publish: Callable[[str], None],
        *,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        flush_tokens: int = FLUSH_TOKENS,
    ):
        self._tokenizer = tokenizer
        self._stops = list(stops)
        self._publish = publish
        self._flush_interval_s = flush_interval_s
        self._flush_tokens = flush_tokens
        self._detokenizer = NaiveStreamingDetokenizer(tokenizer.hf)
        self._newline_tokens: dict[int, bool] = {}
        self._sent = ""
        self._unsent_tokens = 0
        self._flushed_at_s = time.monotonic()
        self._stopped = False  # a stop string was reached: nothing more is published

    @property
    def sent(self) -> str:
        return self._sent

    def pace(self, factor: float) -> None:
        """Publish `factor` times less often than alone (FLUSH_INTERVAL_S, FLUSH_TOKENS)."""
        self._flush_interval_s = FLUSH_INTERVAL_S * factor
        self._flush_tokens = max(1, round(FLUSH_TOKENS * factor))

    def push(self, token: int) -> None:
        """One generated token (end-of-sequence tokens are not text and are skipped)."""
        if self._stopped or token in self._tokenizer.eos_token_ids:
            return
        self._detokenizer.add_token(token)
        self._unsent_tokens += 1
        now = time.monotonic()
        due = now - self._flushed_at_s >= self._flush_interval_s
        if due or self._unsent_tokens >= self._flush_tokens:
            self._flush(self._detokenizer.text, final=False)
            self._flushed_at_s, self._unsent_tokens = now, 0
        elif self._ends_line(token):
            # The detokenizer re-decodes the current line when read, and closes the line when
            # what it reads ends with a newline: read it right after one (mlx-lm reads it every
            # token), or a later read could close the line with bytes after the newline in it.
            self._detokenizer.text  # noqa: B018

    def _ends_line(self, token: int) -> bool:
        known = self._newline_tokens.get(token)
        if known is None:
            known = self._newline_tokens[token] = "\n" in self._tokenizer.decode([token])
        return known

    def close(self) -> None:
        """The sequence ended: publish the rest, up to its final text (the job's result)."""
        if self._stopped:
            return
        self._detokenizer.finalize()
        tokens = [t for t in self._detokenizer.tokens if t not in self._tokenizer.eos_token_ids]
        final = cut_at_stop(self._tokenizer.decode(tokens), self._stops)
        if not final.startswith(self._sent):  # never seen with mlx-lm's detokenizer; say so
            log.warning("streamed text %r is not the start of the result", self._sent[-40:])
            return
        self._flush(final, final=True)
        self._stopped = True

    def _flush(self, text: str, final: bool) -> None:
        visible = cut_at_stop(text, self._stops)
        if visible != text:
            self._stopped = True
        elif not final:
            visible = text[: len(text) - held_back(text, self._stops)]
        if len(visible) > len(self._sent) and visible.startswith(self._sent):
            delta = visible[len(self._sent) :]
            self._sent = visible
            self._publish(delta)


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` may begin a stop string (the longest suffix
    that is a proper prefix of one): those wait until the next tokens say."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class DecodeText:
    """The engine's `stop_when` callback for one job's single-sequence decode: stop strings
    (every rank) and, on the lead rank, the text published through `io.text` as it decodes."""

    def __init__(self, io: JobIO, tokenizer: ChatTokenizer, stops: Sequence[str], lead: bool):
        self._stop = stop_check(tokenizer, stops)
        self._stream = TextStream(tokenizer, stops, io.text) if lead else None
        self._seen = 0

    def pace(self, factor: float) -> None:
        if self._stream is not None:
            self._stream.pace(factor)

    def stop_when(self, tokens: list[int]) -> bool:
        self._push(tokens)
        return self._stop is not None and self._stop(tokens)

    def close(self, tokens: list[int]) -> None:
        """Decoding ended with `tokens` (the engine does not ask about the last one)."""
        if self._stream is not None:
            self._push(tokens)
            self._stream.close()

    def _push(self, tokens: list[int]) -> None:
        if self._stream is not None:
            for token in tokens[self._seen :]:
                self._stream.push(token)
            self._seen = len(tokens)
