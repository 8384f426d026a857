"""`ringq up` keeps its services running, as compose's `restart: unless-stopped` does.

A dispatcher, node agent or embedded Redis that exits while `up` runs is started again after a
backoff that doubles with each restart of the last minute. One restarted `max_restarts` times
within `window_s` that exits again is left stopped, with a message naming its log (for the
embedded Redis, `up` stops). Restart counts go to Redis (jobs/service_status.py) for `ringq top`."""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import Protocol

import redis

from jobs.errors import RingqError
from jobs.redis_server import RedisHandle, ensure_redis
from jobs.service_status import (
    ServiceState,
    ServiceStatus,
    clear_service_statuses,
    write_service_status,
)
from jobs.settings import Settings
from ring_worker.runtime.node_agent import log_tail

log = logging.getLogger(__name__)
REDIS_LABEL = "redis"


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5
    window_s: float = 60.0
    first_backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def backoff_s(self, recent_restarts: int) -> float | None:
        """Seconds to wait before starting a service again that has been restarted
        `recent_restarts` times within the window; None: a crash loop, leave it stopped."""
        if recent_restarts >= self.max_restarts:
            return None
        return min(self.first_backoff_s * 2**recent_restarts, self.max_backoff_s)


@dataclass
class _Track:
    """One supervised service, as the supervisor sees it."""

    label: str
    log_path: Path
    pid: int | None
    restarts: int = 0
    restart_times_s: list[float] = field(default_factory=list)  # monotonic, within the window
    due_at_s: float | None = None  # monotonic time of the next start while it is down
    last_restart_at: float | None = None  # unix s
    exit_code: int | None = None
    stopped: bool = False

    def status(self) -> ServiceStatus:
        if self.stopped:
            state = ServiceState.STOPPED
        else:
            state = ServiceState.RESTARTING if self.due_at_s is not None else ServiceState.RUNNING
        return ServiceStatus(
            label=self.label,
            state=state,
            pid=self.pid,
            restarts=self.restarts,
            last_restart_at=self.last_restart_at,
            last_exit_code=self.exit_code,
            log_path=str(self.log_path),
        )


class Supervised(Protocol):
    """What a supervisor watches (cli/services.py `LocalCluster`): its children, each restarted
    by label, and the Redis it may have started."""

    children: list[tuple[str, Popen, Path]]
    redis: RedisHandle | None
    settings: Settings

    @property
    def url(self) -> str: ...

    def restart(self, label: str) -> Popen: ...


class Supervisor:
    """Call `tick()` every fraction of a second from `up`'s loop; it never blocks for long."""

    def __init__(
        self,
        cluster: Supervised,
        policy: RestartPolicy | None = None,
        say: Callable[[str], None] = log.warning,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cluster = cluster
        self.policy = policy or RestartPolicy()
        self.say = say
        self.clock = clock
        self.tracks: dict[str, _Track] = {}
        for label, process, log_path in cluster.children:
            self.tracks[label] = _Track(label, log_path, process.pid)
        handle = cluster.redis
        if handle is not None and handle.owned and handle.data_dir is not None:
            self.tracks[REDIS_LABEL] = _Track(
                REDIS_LABEL, handle.data_dir / "redis.log", handle.pid
            )
        self._unpublished = set(self.tracks)
        self._conn = redis.Redis.from_url(cluster.url, socket_connect_timeout=1, socket_timeout=1)
        self._publish(clear_first=True)

    def tick(self) -> None:
        now_s = self.clock()
        self._tick_redis(now_s)
        for label, process, _ in list(self.cluster.children):
            track = self.tracks[label]
            if track.stopped:
                continue
            if track.due_at_s is None and process.poll() is not None:
                self._exited(track, process.returncode, now_s)
            if track.due_at_s is not None and now_s >= track.due_at_s:
                track.pid = self.cluster.restart(label).pid
                self._started(track, now_s)
        self._publish()

    def _tick_redis(self, now_s: float) -> None:
        track = self.tracks.get(REDIS_LABEL)
        handle = self.cluster.redis
        if track is None or handle is None or handle.process is None:
            return
        if track.due_at_s is None and handle.process.poll() is not None:
            self._exited(track, handle.process.returncode, now_s)
            if track.stopped:
                raise RingqError(
                    f"the embedded Redis keeps exiting ({track.restarts} restarts within "
                    f"{self.policy.window_s:.0f} s): stopping. Its log: {track.log_path}\n"
                    + log_tail(track.log_path)
                )
        if track.due_at_s is not None and now_s >= track.due_at_s:
            try:
                self.cluster.redis = ensure_redis(self.cluster.settings)
            except RingqError as exc:
                self.say(f"redis did not start again: {exc}")
                track.due_at_s = now_s + (self.policy.backoff_s(0) or 1.0)
                return
            track.pid = self.cluster.redis.pid
            self._started(track, now_s)
            self._unpublished |= set(self.tracks)  # statuses written while it was down are lost

    def _exited(self, track: _Track, code: int | None, now_s: float) -> None:
        track.exit_code = code
        track.restart_times_s = [
            t for t in track.restart_times_s if now_s - t < self.policy.window_s
        ]
        backoff_s = self.policy.backoff_s(len(track.restart_times_s))
        self._unpublished.add(track.label)
        if backoff_s is None:
            track.stopped = True
            track.pid = None
            self.say(
                f"{track.label} exited with code {code} after {len(track.restart_times_s)} "
                f"restarts within {self.policy.window_s:.0f} s: a crash loop, left stopped. "
                f"Its log: {track.log_path}"
            )
            return
        track.due_at_s = now_s + backoff_s
        self.say(
            f"{track.label} exited with code {code}; restarting in {backoff_s:.1f} s "
            f"(log: {track.log_path})"
        )

    def _started(self, track: _Track, now_s: float) -> None:
        track.due_at_s = None
        track.restarts += 1
        track.restart_times_s.append(now_s)
        track.last_restart_at = time.time()
        self._unpublished.add(track.label)
        self.say(f"{track.label} restarted (pid {track.pid}, restart {track.restarts})")

    def _publish(self, clear_first: bool = False) -> None:
        """Write changed statuses; while Redis is down they wait for the next tick."""
        if not self._unpublished:
            return
        try:
            if clear_first:
                clear_service_statuses(self._conn)
            for label in sorted(self._unpublished):
                write_service_status(self._conn, self.tracks[label].status())
        except redis.RedisError as exc:
            log.debug("service statuses not written yet: %s", exc)
            return
        self._unpublished.clear()

    def close(self) -> None:
        self._conn.close()


def services_line(statuses: list[ServiceStatus]) -> str:
    """One line for `ringq top`: each supervised service, with its restarts if it had any."""
    if not statuses:
        return "[dim]services: not started by `ringq up`[/dim]"
    parts = []
    for s in statuses:
        text = f"{s.label} {s.state.value}"
        if s.restarts and s.last_restart_at is not None:
            stamp = time.strftime("%H:%M:%S", time.localtime(s.last_restart_at))
            text += f" ({s.restarts} restarts, last {stamp})"
        parts.append(f"[red]{text}[/red]" if s.state != ServiceState.RUNNING else text)
    return "services: " + ", ".join(parts)
