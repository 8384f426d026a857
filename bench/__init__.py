"""Benchmarks. Run each from the repository root as a module: `uv run python -m bench.NAME`."""
