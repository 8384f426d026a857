"""cli/http/auth.py's keys, route by route: with RINGQ_API_KEYS set, every route the app has (the
ones added later included) refuses a request without one of the keys."""

import re
import urllib.error
import urllib.request
from collections.abc import Iterator

from starlette.routing import Mount

from cli.http.app import create_app
from jobs.redis_server import connect
from jobs.settings import Settings, get_settings
from tests.cli.http_serving import call, serving

KEYS = ["k-one", "k-two"]
# Paths anyone may open with keys set, each with its reason. None today: the dashboard page
# itself and its script need the key too (it arrives once as /?key=, then as a cookie).
PUBLIC: dict[tuple[str, str], str] = {}
PATH_PARAM = re.compile(r"\{[^}]+\}")


def every_route(settings: Settings, redis_url: str, fill: bool = True) -> list[tuple[str, str]]:
    """(method, path) for every route and method of the app, path params filled in (`fill`)
    or left as the route's template."""
    conn = connect(redis_url)
    try:
        app = create_app(conn, settings, KEYS)
    finally:
        conn.close()
    routes = list(walk(app.routes))
    documented = {PATH_PARAM.sub("{}", path) for path in app.openapi()["paths"]}
    assert documented <= {PATH_PARAM.sub("{}", path) for path, _ in routes}, "the walk missed some"
    found = []
    for path, methods in routes:
        concrete = PATH_PARAM.sub("dummy-id", path) if fill else path
        found += [(method, concrete) for method in sorted(methods)]
    return found


def walk(routes: list, prefix: str = "") -> Iterator[tuple[str, set[str]]]:
    """(path, methods) of routes, into included routers (FastAPI >= 0.16x keeps them as one
    entry of app.routes) and mounts (static files: one file there and one that isn't)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from walk(included.routes, prefix + route.include_context.prefix)
        elif isinstance(route, Mount):
            yield f"{prefix}{route.path}/dashboard.js", {"GET"}
            yield f"{prefix}{route.path}/nothing-here", {"GET"}
        else:
            yield prefix + route.path, set(route.methods)


def test_every_route_of_the_app_needs_a_key(redis_url, redis_conn):
    settings = Settings(home=get_settings().home, redis_url=redis_url)
    routes = every_route(settings, redis_url)
    assert len(routes) >= 20, routes  # the enumeration found the routers, not just a few
    json_body = {"Content-Type": "application/json"}
    with serving(settings, redis_url, keys=KEYS) as url:
        for method, path in routes:
            if (method, path) in PUBLIC:
                continue
            body = b"{}" if method in {"POST", "PUT", "PATCH"} else None
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Cookie": "ringq_key=wrong"}):
                status, error, _ = call(method, f"{url}{path}", body, {**json_body, **headers})
                assert status == 401, (method, path, headers, status, error)
                if method != "HEAD":  # a HEAD answer has no body
                    assert error["error"]["code"] == "invalid_api_key", (method, path)
            # The same request with a key gets past the check (whatever the route then says).
            status, _, _ = call_any(method, f"{url}{path}", body, json_body)
            assert status not in {401, 405}, (method, path, status)


def call_any(method: str, url: str, body: bytes | None, headers: dict[str, str]) -> tuple:
    """call() for routes whose answer is not JSON (the page, static files, an event stream)."""
    headers = {**headers, "Authorization": f"Bearer {KEYS[1]}"}
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, None, dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, None, dict(error.headers)
