"""Three "hosts" on one Linux machine for the multi-host rehearsal (bench/multihost.py).

Each host is a named network namespace (`ip netns`) with one veth leg on a bridge
(10.78.0.1 a, .2 b, .3 c; this process watches from 10.78.0.254) and a mount namespace kept
alive by a bind mount, in which a private tmpfs covers HOME: every host sees its own RINGQ_HOME
at the same path, and no other host (nor this process) sees its files. Needs root and iproute2.
"""

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "10.78.0"
OBSERVER = f"{SUBNET}.254"
RUN_DIR = Path("/run/ringq-multihost")
RUN_LOCK = Path("/run/ringq-multihost.lock")
HOME = Path("/tmp/ringq-multihost-home")
BRIDGE = "rqmh0"
ROOT = Path(__file__).resolve().parents[1]


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=30)


def namespaces_unavailable() -> str | None:
    """Why this machine cannot hold the hosts, or None when it can."""
    missing = [tool for tool in ("ip", "unshare", "nsenter", "mount") if not shutil.which(tool)]
    if missing:
        return f"missing {', '.join(missing)} (iproute2, util-linux)"
    probe = subprocess.run(
        [
            "unshare",
            "-m",
            "-n",
            "--",
            "sh",
            "-c",
            "mount -t tmpfs probe /mnt && ip link add p0 type veth peer name p1",
        ],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"no network and mount namespaces here (root needed): {probe.stderr.strip()}"
    return None


def allow_bridged(allowed: bool) -> None:
    """Let frames cross the bridge where iptables filters bridged traffic (br_netfilter) and a
    FORWARD policy of DROP (dockerd sets one) would cut every host off from the others."""
    if shutil.which("iptables") is None:
        return
    rule = ["FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"]
    while sh("iptables", "-C", *rule, check=False).returncode == 0:
        sh("iptables", "-D", *rule, check=False)
    if allowed:
        sh("iptables", "-I", *rule, check=False)


class Host:
    """One namespace pair: its address, and commands run inside it."""

    def __init__(self, name: str, index: int):
        self.name = name
        self.address = f"{SUBNET}.{index}"
        self.netns = f"ringq-mh-{name}"
        self.mount_file = RUN_DIR / f"{name}.mnt"
        self.veth = f"rqmh-{name}"

    def enter(self, args: list[str]) -> list[str]:
        """`args` inside this host, from the repository root. Without LD_PRELOAD: a preloaded
        OpenBLAS starts its threads in nsenter, and a threaded process cannot enter a mount
        namespace (setns: EINVAL). Rank processes preload it again themselves."""
        return [
            "env",
            "-u",
            "LD_PRELOAD",
            "nsenter",
            f"--net=/run/netns/{self.netns}",
            f"--mount={self.mount_file}",
            "--",
            "env",
            f"--chdir={ROOT}",
            *args,
        ]

    def start(self, args: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen:
        """A long-running process; its output goes to HOME/<log_name> on this host."""
        command = f'mkdir -p {HOME}/out && exec "$@" >>{HOME}/out/{log_name} 2>&1'
        return subprocess.Popen(
            self.enter(["sh", "-c", command, "sh", *args]),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def run(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        input_text: str | None = None,
        timeout_s: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.enter(args),
            env=env,
            input=input_text,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def read(self, pattern: str) -> str:
        """The files under this host's HOME matching a shell glob, concatenated."""
        return self.run(["sh", "-c", f"cat {HOME}/{pattern} 2>/dev/null || true"]).stdout

    def pids(self) -> list[int]:
        out = sh("ip", "netns", "pids", self.netns, check=False).stdout
        return [int(pid) for pid in out.split()]

    def create(self) -> None:
        sh("ip", "netns", "add", self.netns)
        sh(
            "ip",
            "link",
            "add",
            self.veth,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            self.netns,
        )
        sh("ip", "link", "set", self.veth, "master", BRIDGE, "up")
        for command in (
            "ip link set lo up",
            f"ip addr add {self.address}/24 dev eth0",
            "ip link set eth0 up",
        ):
            sh("ip", "netns", "exec", self.netns, *command.split())
        self.mount_file.touch()
        sh(
            "unshare",
            f"--mount={self.mount_file}",
            "--propagation",
            "private",
            "--",
            "mount",
            "-t",
            "tmpfs",
            "-o",
            "size=512m,mode=700",
            f"rqmh-{self.name}",
            str(HOME),
        )

    def destroy(self) -> None:
        """Gone for good: every process in it killed, its network and its disk removed."""
        for _ in range(50):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        sh("ip", "netns", "del", self.netns, check=False)
        sh("umount", str(self.mount_file), check=False)
        self.mount_file.unlink(missing_ok=True)
        sh("ip", "link", "del", self.veth, check=False)  # gone with the namespace, normally

    def block(self, other: "Host", blocked: bool) -> None:
        """Drop (or restore) this host's traffic to `other`: a cut link on one side."""
        verb = "add" if blocked else "del"
        sh(
            "ip",
            "netns",
            "exec",
            self.netns,
            "ip",
            "route",
            verb,
            "blackhole",
            f"{other.address}/32",
            check=False,
        )


class Hosts:
    """a, b and c on one bridge; `with Hosts() as hosts:` removes everything at the end."""

    def __init__(self, names: tuple[str, ...] = ("a", "b", "c")):
        self.hosts = {name: Host(name, i + 1) for i, name in enumerate(names)}

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> "Hosts":
        self.lock = RUN_LOCK.open("w")
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock.close()
            raise RuntimeError(
                f"another rehearsal holds {RUN_LOCK}: its hosts are in use"
            ) from None
        self.close()  # what a killed earlier run left behind
        try:
            RUN_DIR.mkdir(parents=True, exist_ok=True)
            sh("mount", "--bind", str(RUN_DIR), str(RUN_DIR))
            sh("mount", "--make-private", str(RUN_DIR))
            HOME.mkdir(mode=0o700, exist_ok=True)
            sh("ip", "link", "add", BRIDGE, "type", "bridge")
            sh("ip", "addr", "add", f"{OBSERVER}/24", "dev", BRIDGE)
            sh("ip", "link", "set", BRIDGE, "up")
            allow_bridged(True)
            for host in self.hosts.values():
                host.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
        self.lock.close()  # releases the flock

    def close(self) -> None:
        for host in self.hosts.values():
            host.destroy()
        sh("ip", "link", "del", BRIDGE, check=False)
        allow_bridged(False)
        if RUN_DIR.is_dir():
            for leftover in RUN_DIR.glob("*.mnt"):
                sh("umount", str(leftover), check=False)
                leftover.unlink(missing_ok=True)
            sh("umount", str(RUN_DIR), check=False)
        with contextlib.suppress(OSError):
            HOME.rmdir()
