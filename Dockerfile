# One image for every ringq service of compose.yaml (dispatcher, node agents, CLI); the
# `dashboard` stage adds rq-dashboard from the same lock file. BASE_IMAGE: any Debian-like image
# with python3.11 and pip on PATH (compose.yaml passes RINGQ_BASE_IMAGE).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS ringq

# OpenBLAS: CPU rank processes preload it (fp32 matmul 25-35x faster than MLX's reference BLAS).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libopenblas0-pthread \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir uv

ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PROJECT_ENVIRONMENT=/app/.venv \
    PATH=/app/.venv/bin:$PATH \
    RINGQ_HOME=/data
WORKDIR /app

# Dependencies first, in their own layer: code edits do not reinstall MLX.
COPY pyproject.toml uv.lock README.md ./
RUN uv sync --frozen --no-dev --no-install-project
COPY admission ./admission
COPY cli ./cli
COPY jobs ./jobs
COPY ring_worker ./ring_worker
RUN uv sync --frozen --no-dev

ENTRYPOINT ["ringq"]
CMD ["--help"]

FROM ringq AS dashboard
RUN uv sync --frozen --no-dev --group dashboard
ENTRYPOINT ["rq-dashboard"]
