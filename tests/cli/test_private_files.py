"""What ringq creates under RINGQ_HOME is its user's alone: folders 0700, files 0600, whatever
the umask it was started with (cli/main.py keep_files_private), through a real `ringq submit`."""

import os
import stat
import subprocess
import sys


def test_ringq_home_and_what_it_writes_are_private(tmp_path, redis_url):
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    document = tmp_path / "doc.txt"
    document.write_text("A short document.")
    env = {**os.environ, "RINGQ_HOME": str(home), "RINGQ_REDIS_URL": redis_url}
    command = [sys.executable, "-m", "cli.main", "submit", "prefill", str(document)]
    subprocess.run(  # umask 022: what a login shell gives
        ["sh", "-c", 'umask 022 && exec "$@"', "sh", *command, "--model", "smollm2"],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    made = list(home.rglob("*"))
    assert made, "submit caches the model's metadata under RINGQ_HOME"
    for path in made:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
