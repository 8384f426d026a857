"""A node's prefill checkpoints of jobs that have ended are deleted by its node agent.

A rank keeps its checkpoint when its prefill fails, for the retry; if the retry runs elsewhere or
the job ends, nobody else deletes it. The agent sweeps `RINGQ_HOME/checkpoints/<job>` of every job
that is final or gone every SWEEP_INTERVAL_S. File operations only: the agent imports no MLX."""

import logging
import shutil
from pathlib import Path

from jobs.errors import JobNotFoundError
from jobs.store import JobStore

log = logging.getLogger(__name__)
SWEEP_INTERVAL_S = 60.0


def sweep_checkpoints(store: JobStore, home: Path) -> list[str]:
    """Delete the checkpoints of ended jobs; the ids of those deleted."""
    root = home / "checkpoints"
    swept = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            ended = store.get(folder.name).state.is_final
        except JobNotFoundError:
            ended = True  # expired, or never a job of this Redis
        if ended:
            shutil.rmtree(folder, ignore_errors=True)
            swept.append(folder.name)
            log.info("job %s: its ended prefill's checkpoints deleted", folder.name)
    return swept
