"""One rank of the prefix-reuse fidelity test (a fresh process per rank): answer prompts in
order through automatic prefix reuse, writing each answer and its reused token count."""

import json
import logging
import sys
from pathlib import Path
from typing import cast

from jobs.prefix_cache import Layout
from jobs.prefix_index import PrefixIndex
from jobs.redis_server import connect
from ring_worker.engine.group import join_group
from ring_worker.engine.ring_attention import Exchange, KVLayout
from ring_worker.engine.strategies import make_engine
from ring_worker.runtime.cache_store import node_store
from ring_worker.runtime.prefix_reuse import RankPrefixCache, view_of
from tests.ring_worker.tiny import load_tiny

CHUNK_TOKENS = 96
MAX_TOKENS = 16


def main() -> None:
    model_dir, rank, addresses, prompts_file, out_dir, strategy, exchange, kv_layout = sys.argv[1:9]
    redis_url, home, label = sys.argv[9:12]
    logging.basicConfig(level=logging.INFO, format=f"rank {rank} %(levelname)s %(message)s")
    group = join_group(json.loads(addresses), int(rank), Path(out_dir))
    model = load_tiny(Path(model_dir))
    engine = make_engine(
        model, group, strategy, cast(Exchange, exchange), cast(KVLayout, kv_layout)
    )
    layout: Layout = "pipeline" if strategy == "pipeline" else "ring"
    view = view_of(engine, f"node{rank}", layout, kv_layout)
    cache = RankPrefixCache(
        PrefixIndex(connect(redis_url)), node_store(Path(home), view.node, 10**9), view,
        f"tiny:{model_dir}",
    )  # fmt: skip
    answers = []
    for number, tokens in enumerate(json.loads(Path(prompts_file).read_text())):
        prefill, reused = cache.prefill(engine, tokens, CHUNK_TOKENS)
        decoded = engine.decode(prefill, MAX_TOKENS)
        cache.keep(engine, f"{label}-{number}", tokens, prefill, reused)
        answers.append({"tokens": decoded.tokens, "reused": reused.tokens if reused else 0})
    (Path(out_dir) / f"answers-rank{rank}.json").write_text(json.dumps(answers))


if __name__ == "__main__":
    main()
