"""The FastAPI app of `ringq serve`: routes per area, OpenAI-shaped errors, bearer keys, and
the thread that feeds its batches (jobs/batch_feed.py) while it serves."""

import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import redis
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from cli.http import chat, dashboard, jobs_api, openai_batches, openai_files
from cli.http.auth import key_middleware, origin_middleware, parse_keys
from cli.http.errors import install_handlers
from cli.http.guards import BodyLimits, SecurityHeaders
from jobs.batch_feed import BatchFeeder
from jobs.settings import Settings


def served_settings(settings: Settings) -> Settings:
    """The settings requests are checked with: RINGQ_ALLOWED_DIRS unset means no directory, so
    an HTTP caller names built-in models only (jobs/model_rule.py)."""
    return settings.model_copy(update={"allowed_dirs": settings.allowed_dirs or []})


@asynccontextmanager
async def feeding(app: FastAPI) -> AsyncIterator[None]:
    """The batch feeder runs in a thread while the app serves."""
    feeder: BatchFeeder = app.state.feeder
    stop = threading.Event()
    thread = threading.Thread(target=feeder.run, args=(stop,), name="batch-feeder", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        feeder.wake.set()
        thread.join(timeout=10)


def create_app(conn: redis.Redis, settings: Settings, api_keys: Sequence[str]) -> FastAPI:
    """The app; `api_keys` are tenants, RINGQ_ADMIN_KEYS (in `settings`) see every tenant."""
    app = FastAPI(
        lifespan=feeding,
        title="ringq",
        summary="OpenAI-compatible Files, Batches and Chat over ringq jobs, and its dashboard",
        docs_url=None,  # FastAPI's docs pages load their scripts from a CDN; /openapi.json stays
        redoc_url=None,
    )
    app.state.conn = conn
    app.state.settings = served_settings(settings)
    app.state.feeder = BatchFeeder(conn, app.state.settings)
    admin_keys = parse_keys(settings.admin_keys)
    every_key = [*api_keys, *admin_keys]
    limits = (settings.max_request_bytes, settings.max_upload_bytes, settings.max_json_depth)
    app.add_middleware(BodyLimits, *limits)  # added first: runs last, once the key is checked
    app.middleware("http")(key_middleware(list(api_keys), admin_keys))
    app.middleware("http")(origin_middleware(every_key))
    app.add_middleware(SecurityHeaders)  # added last: runs first, so every answer has them
    install_handlers(app)
    for module in (openai_files, openai_batches, chat, jobs_api, dashboard):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=dashboard.STATIC_DIR), name="static")
    return app
