"""Start-up stays small: `ringq status` and `ringq submit --help` load neither RQ nor MLX,
transformers or rich (cli/main.py imports each command's module on first use)."""

import json
import os
import subprocess
import sys

import pytest

from jobs.schemas import JobKind, JobSpec
from jobs.store import JobStore

HEAVY = ("rq", "mlx", "mlx_lm", "transformers", "rich")

# Runs `ringq ARGS` in this process, then writes the top-level packages it loaded to argv[1].
WRAPPER = """
import atexit, json, sys
out = sys.argv.pop(1)
packages = lambda: sorted({name.split(".")[0] for name in sys.modules})
atexit.register(lambda: open(out, "w").write(json.dumps(packages())))
sys.argv[0] = "ringq"
from cli.main import main
main()
"""


def loaded_packages(args: list[str], tmp_path, redis_url: str) -> set[str]:
    out = tmp_path / "modules.json"
    done = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(out), *args],
        env={**os.environ, "RINGQ_REDIS_URL": redis_url, "RINGQ_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(out.read_text()))


@pytest.mark.parametrize("args", [["status", "lazy1"], ["submit", "--help"]])
def test_light_commands_load_no_heavy_package(args, tmp_path, redis_url, redis_conn):
    spec = JobSpec(kind=JobKind.PREFILL, document="text", model="random:tiny-llama")
    JobStore(redis_conn).create("lazy1", spec)
    loaded = loaded_packages(args, tmp_path, redis_url)
    assert {"click", "cli"} <= loaded  # the wrapper did run the command
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))
