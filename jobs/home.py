"""Where ringq keeps its files when RINGQ_HOME is unset: the platform's data directory."""

from pathlib import Path


def default_home() -> Path:
    import platformdirs  # only when RINGQ_HOME is unset: its import is most of a setting's cost

    return Path(platformdirs.user_data_dir("ringq"))
