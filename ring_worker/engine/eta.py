"""A prefill's remaining seconds, from the pace of the chunks it has run.

A chunk of prompt tokens [s, e) costs about a·(e − s) + b·(e² − s²): the weights' work grows with
its tokens, attention's with the positions each token attends to. How fast each part runs differs
by backend and length (fused attention kernels, CPU attention materialising scores), so the two
rates are fitted to the chunks seen (least squares on each chunk's seconds) rather than taken
from the FLOPs, which weigh both alike. Until the fit has enough chunks, or where it comes out
negative (noise), the estimate scales the seconds so far by the prompt's FLOPs left over done
(`seconds_left`)."""

from collections.abc import Callable
from dataclasses import dataclass, field

Cost = Callable[[int, int], float]  # the work of prompt tokens [start, end): their FLOPs
MIN_CHUNKS = 3  # chunk times the fit needs before it is trusted


def seconds_left(cost: Cost, elapsed_s: float, start: int, done: int, total: int) -> float:
    """A prefill's seconds still to go: the time tokens [start, done) took, scaled by the work
    of [done, total) over theirs (later tokens attend to more, so they cost more)."""
    return elapsed_s * cost(done, total) / cost(start, done)


@dataclass
class PrefillPace:
    """The chunks of one prefill from `start` (a resumed one's first token): their ends and the
    seconds since the first was seen."""

    cost: Cost
    start: int
    seen: list[tuple[int, float]] = field(default_factory=list)  # (tokens done, seconds)

    def add(self, done: int, elapsed_s: float) -> None:
        if not self.seen or done > self.seen[-1][0]:
            self.seen.append((done, elapsed_s))

    def seconds_left(self, total: int) -> float | None:
        """None before any chunk has been timed."""
        if not self.seen or self.seen[-1][0] <= self.start:
            return None
        done, elapsed = self.seen[-1]
        rates = self._fit()
        if rates is None:
            return seconds_left(self.cost, elapsed, self.start, done, total)
        per_token, per_square = rates
        return per_token * (total - done) + per_square * (total**2 - done**2)

    def _fit(self) -> tuple[float, float] | None:
        """(a, b) minimising the squared error of each chunk's seconds; None if too few chunks
        or a rate is negative."""
        points = [(self.start, 0.0), *self.seen] if self.seen[0][0] > self.start else self.seen
        unit = float(points[-1][0])  # tokens in units of the furthest done: sums stay near 1
        chunks = [
            ((e - s) / unit, (e * e - s * s) / unit**2, t1 - t0)
            for (s, t0), (e, t1) in zip(points, points[1:], strict=False)
        ]
        if len(chunks) < MIN_CHUNKS:
            return None
        xx = sum(x * x for x, _, _ in chunks)
        xq = sum(x * q for x, q, _ in chunks)
        qq = sum(q * q for _, q, _ in chunks)
        xy = sum(x * y for x, _, y in chunks)
        qy = sum(q * y for _, q, y in chunks)
        det = xx * qq - xq * xq
        if det <= 1e-12 * xx * qq:  # chunks of one shape: the two rates cannot be told apart
            return None
        per_token, per_square = (xy * qq - qy * xq) / det, (qy * xx - xy * xq) / det
        if per_token < 0 or per_square < 0:
            return None
        return per_token / unit, per_square / unit**2
