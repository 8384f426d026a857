"""One rank of the overlap-order test: real ring collectives, wrapped to log the order in which
rotate_blocks posts communication and waits on it."""

import json
import sys
from pathlib import Path

import mlx.core as mx

from ring_worker.engine.engines import RingEngine
from ring_worker.engine.group import join_group
from tests.ring_worker.tiny import load_tiny

EVENTS: list[dict] = []


def record(name: str, real):
    def wrapper(*args, **kwargs):
        result = real(*args, **kwargs)
        arrays = [a for a in args if isinstance(a, mx.array)]
        arrays += [a for arg in args if isinstance(arg, list) for a in arg]
        EVENTS.append({"op": name, "ids": [id(a) for a in arrays], "out": id(result)})
        return result

    return wrapper


def main() -> None:
    model_dir, rank, addresses, out_dir = sys.argv[1:5]
    group = join_group(json.loads(addresses), int(rank), Path(out_dir))
    engine = RingEngine(load_tiny(Path(model_dir)), group, exchange="rotate")
    mx.distributed.send = record("send", mx.distributed.send)
    mx.distributed.recv = record("recv", mx.distributed.recv)
    mx.async_eval = record("async_eval", mx.async_eval)
    mx.eval = record("eval", mx.eval)
    engine.prefill(list(range(1, 97)), chunk_tokens=96)  # one chunk, every rank has 2 blocks
    (Path(out_dir) / f"events-rank{rank}.json").write_text(json.dumps(EVENTS))


if __name__ == "__main__":
    main()
