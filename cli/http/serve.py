"""`ringq serve`: the HTTP API and the dashboard, on uvicorn."""

import logging

import click

from cli.common import redis_url_for
from jobs.redis_server import connect
from jobs.settings import get_settings

REDIS_RIDE_OUT_S = 5.0  # a Redis restart does not fail requests for this long


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="info",
    show_default=True,
)
def serve(host: str, port: int, log_level: str) -> None:
    """HTTP API and web dashboard: OpenAI-compatible /v1/files, /v1/batches,
    /v1/chat/completions and /v1/models, ringq's /api/jobs, the dashboard at /.

    Keys: RINGQ_API_KEYS (comma-separated) makes every route need `Authorization: Bearer KEY`
    (the dashboard: open /?key=KEY once); each key sees only what it created, a key of
    RINGQ_ADMIN_KEYS sees all. Without keys it binds only to a loopback address.
    """
    import uvicorn  # not on the path of the other commands: it takes a while to import

    from cli.http.app import create_app
    from cli.http.auth import check_bind, parse_keys

    settings = get_settings()
    keys = parse_keys(settings.api_keys)
    admin_keys = parse_keys(settings.admin_keys)
    try:
        check_bind(host, [*keys, *admin_keys])
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    conn = connect(redis_url_for(settings), ride_out_s=REDIS_RIDE_OUT_S)
    app = create_app(conn, settings, keys)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    where = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    auth = (
        f"{len(keys)} tenant key(s), {len(admin_keys)} admin key(s)"
        if keys or admin_keys
        else "no API key (loopback only)"
    )
    click.echo(f"ringq serve: {where}/ (dashboard), {where}/v1 (OpenAI API); {auth}", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
