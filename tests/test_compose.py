"""compose.yaml and the Dockerfile: the services, Redis durability, and that every command they
run is one the CLI really has (a renamed option would otherwise only show up at deploy time)."""

import shutil
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest

from cli.main import cli
from jobs.settings import Settings

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
RINGQ_SERVICES = {"dispatcher", "node-0", "node-1"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def option_names(command: click.Command) -> set[str]:
    return {name for param in command.params for name in param.opts + param.secondary_opts}


def options_used(args: list[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in args if arg.startswith("--")]


def test_images_default_to_the_registry_ones(compose):
    """RINGQ_BASE_IMAGE and RINGQ_REDIS_IMAGE swap in locally built images (no registry)."""
    services = compose["services"]
    assert services["redis"]["image"] == "${RINGQ_REDIS_IMAGE:-redis:7}"
    for name in RINGQ_SERVICES | {"serve", "rq-dashboard"}:
        args = services[name]["build"]["args"]
        assert args == {"BASE_IMAGE": "${RINGQ_BASE_IMAGE:-python:3.11-slim}"}, name


def test_services_and_profiles(compose):
    services = compose["services"]
    assert set(services) == RINGQ_SERVICES | {"redis", "rq-dashboard", "serve"}
    assert services["rq-dashboard"]["profiles"] == ["dashboard"]
    assert services["serve"]["profiles"] == ["api"]
    assert all("profiles" not in services[name] for name in RINGQ_SERVICES | {"redis"})


def test_redis_is_durable(compose):
    redis = compose["services"]["redis"]
    command = redis["command"]
    assert command[0] == "redis-server"
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "everysec"
    assert command[command.index("--protected-mode") + 1] == "no"  # whatever the image's default
    volume = redis["volumes"][0].split(":")
    assert volume[1] == "/data" and volume[0] in compose["volumes"]  # a named volume


@pytest.mark.parametrize("name", sorted(RINGQ_SERVICES | {"serve"}))
def test_ringq_commands_exist(compose, name):
    service = compose["services"][name]
    assert service["build"]["target"] == "ringq"
    assert service["environment"]["RINGQ_REDIS_URL"] == "redis://redis:6379/0"
    subcommand, *args = service["command"]
    command = cli.commands.get(subcommand)
    assert command is not None, f"{name}: `ringq {subcommand}` is not a command"
    unknown = set(options_used(args)) - option_names(command)
    assert not unknown, f"{name}: `ringq {subcommand}` has no {sorted(unknown)}"
    if subcommand == "node":  # reachable by the other nodes under its service name
        assert args[args.index("--address") + 1] == name
        assert args[args.index("--name") + 1] == name


def test_serve_is_published_and_needs_api_keys(compose):
    """`ringq serve` binds every address of its container, as its published port needs; it
    refuses that without RINGQ_API_KEYS, which the service passes on from the host."""
    from cli.http.auth import check_bind

    service = compose["services"]["serve"]
    args = service["command"][1:]
    host, port = args[args.index("--host") + 1], args[args.index("--port") + 1]
    assert host == "0.0.0.0"
    assert service["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert service["environment"]["RINGQ_API_KEYS"] == "${RINGQ_API_KEYS:-}"
    assert service["environment"]["RINGQ_REDIS_URL"] == "redis://redis:6379/0"  # merged env
    with pytest.raises(ValueError, match="RINGQ_API_KEYS"):
        check_bind(host, [])
    check_bind(host, ["a-key"])


@pytest.mark.parametrize("name", ["node-0", "node-1"])
def test_rank_ports_match_settings(compose, name):
    service = compose["services"][name]
    base = int(service["environment"]["RINGQ_RANK_PORT_BASE"])
    span = int(service["environment"]["RINGQ_RANK_PORT_SPAN"])
    defaults = Settings.model_fields  # the defaults, not this shell's RINGQ_* variables
    assert (base, span) == (defaults["rank_port_base"].default, defaults["rank_port_span"].default)
    assert service["expose"] == [f"{base}-{base + span - 1}"]


def test_dashboard_options_exist(compose):
    rq_dashboard_cli = pytest.importorskip("rq_dashboard.cli")
    service = compose["services"]["rq-dashboard"]
    assert service["build"]["target"] == "dashboard"
    unknown = set(options_used(service["command"])) - option_names(rq_dashboard_cli.run)
    assert not unknown and "--json" in service["command"]  # ringq's jobs are JSON, never pickle


def test_dockerfile_stages():
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in text and "FROM ${BASE_IMAGE} AS ringq" in text
    assert "FROM ringq AS dashboard" in text
    assert "uv sync --frozen --no-dev" in text and "libopenblas0-pthread" in text


def compose_plugin() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not compose_plugin(), reason="no `docker compose` (docker + compose plugin)")
@pytest.mark.parametrize("profile", [[], ["--profile", "dashboard"]])
def test_docker_compose_config(profile):
    proc = subprocess.run(
        ["docker", "compose", "-f", str(ROOT / "compose.yaml"), *profile, "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
