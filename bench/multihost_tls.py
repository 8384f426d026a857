"""TLS to Redis in the rehearsal (bench/multihost.py): a second Redis on host a speaking only
TLS with a self-signed CA, which every host gets in RINGQ_REDIS_URL (`ssl_ca_certs`)."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.multihost_cluster import MODEL, PASSWORD, Cluster, alive, wait
from bench.multihost_hosts import HOME
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.store import JobStore


def tls_to_redis(cluster: Cluster) -> str:
    """A second Redis on a speaking only TLS (a self-signed CA, given to every host in
    RINGQ_REDIS_URL's ssl_ca_certs), a dispatcher and a node on c through it, and one job."""
    server = cluster.tls_server
    if not speaks_tls(server):
        raise Unsupported(
            f"{server} ({redis_version(server)}) is built without TLS; redis-py takes "
            "rediss://...?ssl_ca_certs=PATH, so RINGQ_REDIS_URL can carry the CA once the server "
            "speaks TLS (--tls-server names one that does)"
        )
    a, c = cluster.a, cluster.hosts["c"]
    with tempfile.TemporaryDirectory() as tmp:
        here = make_certificates(Path(tmp), a.address)
        for host in (a, c):  # each host holds the CA on its own disk
            for name in ("ca.pem", "server.pem", "server.key") if host is a else ("ca.pem",):
                host.run(
                    ["sh", "-c", f"mkdir -p {HOME}/tls && cat > {HOME}/tls/{name}"],
                    input_text=(here / name).read_text(),
                )
        url = f"rediss://:{PASSWORD}@{a.address}:6380/0?ssl_ca_certs={HOME}/tls/ca.pem"
        env = {**cluster.env, "RINGQ_REDIS_URL": url}
        tls = f"{HOME}/tls"
        processes = [
            a.start(
                [
                    str(server),
                    "--port",
                    "0",
                    "--tls-port",
                    "6380",
                    "--bind",
                    a.address,
                    "--tls-cert-file",
                    f"{tls}/server.pem",
                    "--tls-key-file",
                    f"{tls}/server.key",
                    "--tls-ca-cert-file",
                    f"{tls}/ca.pem",
                    "--tls-auth-clients",
                    "no",
                    "--requirepass",
                    PASSWORD,
                    "--dir",
                    tls,
                    "--save",
                    "",
                ],
                env,
                "redis-tls.log",
            )
        ]
        try:
            local_url = url.replace(f"{HOME}/tls", tmp)
            wait(lambda: alive(local_url), "the TLS Redis", 20)
            processes.append(
                a.start([sys.executable, "-m", "cli.main", "dispatcher"], env, "dispatcher-tls.log")
            )
            processes.append(
                c.start(
                    [
                        sys.executable,
                        "-m",
                        "cli.main",
                        "node",
                        "--name",
                        "tls-c",
                        "--address",
                        c.address,
                    ],
                    env,
                    "node-tls.log",
                )
            )
            store = JobStore(connect(local_url))
            wait(lambda: store.live_nodes(), "node tls-c on the TLS Redis", 60)
            out = a.run(
                [
                    sys.executable,
                    "-m",
                    "cli.main",
                    "submit",
                    "generate",
                    "-",
                    "--prompt",
                    "Go on.",
                    "--max-tokens",
                    "4",
                    "--model",
                    MODEL,
                    "--json",
                ],
                env,
                input_text="Over TLS. " * 20,
                timeout_s=60,
            )
            assert out.returncode == 0, out.stderr
            job_id = json.loads(out.stdout)["id"]
            record = wait(lambda: (r := store.get(job_id)).state.is_final and r, job_id, 120)
            assert record.state == JobState.FINISHED, record.error
            without_ca = url.split("?")[0]
            refused = a.run(
                [sys.executable, "-m", "cli.main", "nodes"], {**env, "RINGQ_REDIS_URL": without_ca}
            )
            assert refused.returncode != 0 and "certificate verify failed" in refused.stderr
        finally:
            for process in processes:
                process.kill()
                process.wait(timeout=10)
    return (
        f"{redis_version(server)} with --tls-port only: dispatcher on a and node on c through "
        f"rediss://...?ssl_ca_certs=<CA on each host>; a job finished; without the CA: "
        f"{refused.stderr.strip().splitlines()[-1]!r}"
    )


def speaks_tls(server: Path) -> bool:
    """Whether `server` knows --tls-port: the config check stops at the first unknown directive,
    so an unknown one after it says it passed (and that nothing started)."""
    probe = subprocess.run(
        [str(server), "--tls-port", "0", "--port", "0", "--not-a-directive", "1"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return "'tls-port" not in probe.stdout + probe.stderr


def redis_version(server: Path) -> str:
    out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=10)
    return "redis " + out.stdout.split("v=")[1].split()[0] if "v=" in out.stdout else "?"


def make_certificates(directory: Path, address: str) -> Path:
    """A self-signed CA and a server certificate for `address` (openssl)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=ringq rehearsal CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={address}",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    )
    (directory / "san.txt").write_text(f"subjectAltName=IP:{address}\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.txt",
        "-out",
        "server.pem",
    )
    return directory


class Unsupported(Exception):
    """A scenario this machine cannot run; recorded as not ok, with why."""
