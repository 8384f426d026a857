"""A node agent's spare rank: a rank process started ahead of time, which has imported its
modules and created its device context, and waits on stdin for the arguments of the rank it is
to become (ring_worker.rank_main --standby). A new group's rank then starts in milliseconds
instead of the ~12 s a fresh interpreter took on an H200 machine."""

import json
import logging
import subprocess
from pathlib import Path

from ring_worker.runtime.processes import spawn_rank

log = logging.getLogger(__name__)


class StandbyRank:
    def __init__(self, env: dict[str, str], log_path: Path):
        self.env = env
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        argv = ["-m", "ring_worker.rank_main", "--standby"]
        self.process = spawn_rank(argv, self.env, self.log_path, stdin=subprocess.PIPE)

    def take(self, argv: list[str], log_path: Path) -> subprocess.Popen | None:
        """The spare process, made into the rank `argv` describes (its output to `log_path`),
        and a new spare started; None when there is no live spare."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None or process.stdin is None:
            self.start()
            return None
        args = [arg for arg in argv if arg not in ("-m", "ring_worker.rank_main")]
        message = {"argv": args, "log": str(log_path)}
        try:
            process.stdin.write((json.dumps(message) + "\n").encode())
            process.stdin.close()
        except OSError as exc:  # it died just now
            log.warning("standby rank %d could not take its job: %s", process.pid, exc)
            process.kill()
            process = None
        self.start()
        return process

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None
