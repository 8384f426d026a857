"""`ringq cache list / drop` as a user runs them, against a real Redis index and real files."""

import json
import time

from jobs.prefix_cache import CacheEntry, CacheShard
from jobs.prefix_index import PrefixIndex
from jobs.store import JobStore
from tests.cli.test_cli import ringq

TOKENS = list(range(600))


def kept_entry(entry_id: str, file: str) -> CacheEntry:
    shard = CacheShard(node="n1", rank=0, file=file, layer_start=0, layer_stop=2,
                       ranges=[(0, 600)], bytes=3 * 1024**2)  # fmt: skip
    now = time.time()
    return CacheEntry(
        id=entry_id, model_key="gguf:/models/smol.gguf:10:20", tokens=600, layout="single",
        kv_dtype="float32", shards=[shard], created_at=now, last_used_at=now, blocks=2,
    )  # fmt: skip


def test_list_and_drop(redis_conn, redis_url, tmp_path):
    env = {"RINGQ_REDIS_URL": redis_url}
    kv_file = tmp_path / "cli-entry.r0.safetensors"
    kv_file.write_bytes(b"kv")
    index = PrefixIndex(redis_conn)
    index.add(kept_entry("cli-entry", str(kv_file)), TOKENS)
    listed = ringq("cache", "list", "--json", env_extra=env)
    assert listed.returncode == 0, listed.stderr
    [mine] = [c for c in json.loads(listed.stdout)["caches"] if c["id"] == "cli-entry"]
    assert mine["tokens"] == 600 and mine["shards"][0]["node"] == "n1"
    table = ringq("cache", "list", env_extra=env)
    assert "cli-entry" in table.stdout and "smol.gguf" in table.stdout
    dropped = ringq("cache", "drop", "cli-entry", env_extra=env)
    assert dropped.returncode == 0, dropped.stderr
    assert "1 files deleted" in dropped.stdout
    assert not kv_file.exists() and index.get("cli-entry") is None
    assert index.match("gguf:/models/smol.gguf:10:20", TOKENS).blocks == 0
    again = ringq("cache", "drop", "cli-entry", env_extra=env)
    assert again.returncode == 1 and "no kept cache cli-entry" in again.stderr


def test_drop_needs_ids_or_all(redis_url):
    result = ringq("cache", "drop", env_extra={"RINGQ_REDIS_URL": redis_url})
    assert result.returncode != 0 and "--all" in result.stderr


def test_submit_with_several_prompts_makes_one_job_per_question(redis_conn, redis_url, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("One document, several questions. " * 20)
    env = {"RINGQ_REDIS_URL": redis_url}
    result = ringq("submit", "generate", str(doc), "--prompt", "Q1", "--prompt", "Q2",
                   env_extra=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    ids = result.stdout.split()
    store = JobStore(redis_conn)
    assert [store.get(i).spec.prompt for i in ids] == ["Q1", "Q2"]
    assert len({store.get(i).spec.document for i in ids}) == 1
    named = ringq("submit", "generate", str(doc), "--prompt", "a", "--prompt", "b", "--id", "x",
                  env_extra=env)  # fmt: skip
    assert named.returncode != 0 and "--id names one job" in named.stderr
