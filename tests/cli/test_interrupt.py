"""Stopping `ringq run` with SIGTERM (or Ctrl-C) takes its rank processes down with it: they run
in their own sessions, so nothing else would."""

import os
import signal
import subprocess
import sys
from contextlib import suppress

import psutil

from tests.helpers import LONG_DOCUMENT, wait_for


def rank_children(pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    ranks = []
    for child in children:
        with suppress(psutil.Error):  # a child that just exited (a zombie) has no cmdline
            if "ring_worker.rank_main" in " ".join(child.cmdline()):
                ranks.append(child)
    return ranks


def test_sigterm_stops_ringq_run_and_its_ranks(tiny_llama_dir, tmp_path):
    document = tmp_path / "doc.txt"
    document.write_text(LONG_DOCUMENT)
    run = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "run", "prefill", str(document), "--json"]
        + ["--model", str(tiny_llama_dir), "--ranks", "2", "--chunk-tokens", "16"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    ranks = wait_for(lambda: len(rank_children(run.pid)) == 2 and rank_children(run.pid), "ranks")
    for rank in ranks:  # frozen mid-run: only SIGKILL after the grace period can end them now
        rank.send_signal(signal.SIGSTOP)
    run.send_signal(signal.SIGTERM)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 130 and stderr.strip().endswith("Aborted."), stderr
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, [p.pid for p in alive]
