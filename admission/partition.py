"""How the engines divide a job's work, defined once: ring_worker runs by these and admission's
estimates count by them (pure)."""

# Ring attention attends earlier chunks' keys in tiles this long, so score matrices stay bounded
# (ring_worker/engine/ring_attention.py); the estimate of a ring's scores counts one tile.
PAST_TILE_TOKENS = 4096


def split_layers(num_layers: int, size: int) -> list[range]:
    """A pipeline's layers per rank: contiguous, as even as possible; the first ranks take one
    extra layer when it is uneven."""
    if not 1 <= size <= num_layers:
        raise ValueError(
            f"a pipeline of {size} ranks needs at least {size} layers; the model has {num_layers}"
        )
    base, extra = divmod(num_layers, size)
    bounds = [0]
    for rank in range(size):
        bounds.append(bounds[-1] + base + (1 if rank < extra else 0))
    return [range(bounds[r], bounds[r + 1]) for r in range(size)]
