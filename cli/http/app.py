"""The FastAPI app of `ringq serve`: routes per area, OpenAI-shaped errors, bearer keys."""

from collections.abc import Sequence

import redis
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from cli.http import chat, dashboard, jobs_api, openai_batches, openai_files
from cli.http.auth import key_middleware, origin_middleware
from cli.http.errors import install_handlers
from jobs.settings import Settings


def create_app(conn: redis.Redis, settings: Settings, api_keys: Sequence[str]) -> FastAPI:
    app = FastAPI(
        title="ringq",
        summary="OpenAI-compatible Files, Batches and Chat over ringq jobs, and its dashboard",
        docs_url=None,  # FastAPI's docs pages load their scripts from a CDN; /openapi.json stays
        redoc_url=None,
    )
    app.state.conn = conn
    app.state.settings = settings
    app.middleware("http")(key_middleware(list(api_keys)))
    app.middleware("http")(origin_middleware(list(api_keys)))  # added last: runs first
    install_handlers(app)
    for module in (openai_files, openai_batches, chat, jobs_api, dashboard):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=dashboard.STATIC_DIR), name="static")
    return app
