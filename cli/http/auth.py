"""Bearer keys (RINGQ_API_KEYS): with keys set, every route needs one of them.

API clients send `Authorization: Bearer <key>`. A browser cannot add that header to a page it
opens, so the dashboard is opened once as `/?key=<key>`: the key is checked and kept in an
HttpOnly cookie that the page's own requests (fetch, EventSource) then carry.

Other web pages the same browser opens must not drive the API: a request that changes something
(POST, DELETE) from another origin is refused, and without keys (loopback only) so is any request
whose Host is not a loopback name, which stops DNS rebinding (evil.example resolving to
127.0.0.1)."""

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Sequence

from fastapi import Request, Response
from starlette.responses import RedirectResponse

from cli.http.errors import ApiError, error_response
from cli.http.tenants import tenant_of

KEY_COOKIE = "ringq_key"
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})


def parse_keys(raw: str | None) -> list[str]:
    """RINGQ_API_KEYS: comma-separated keys; blanks around them are ignored."""
    return [key.strip() for key in (raw or "").split(",") if key.strip()]


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_bind(host: str, keys: Sequence[str]) -> None:
    """Refuse to serve without keys anywhere but on a loopback address."""
    if not keys and not is_loopback(host):
        raise ValueError(
            f"refusing to serve on {host} without API keys: anyone who can reach it could run "
            "jobs. Set RINGQ_API_KEYS (comma-separated bearer keys) or bind 127.0.0.1"
        )


def key_matches(given: str | None, keys: Sequence[str]) -> bool:
    return matching_key(given, keys) is not None


def matching_key(given: str | None, keys: Sequence[str]) -> str | None:
    """The key of `keys` that `given` is, compared with every key in constant time each."""
    if not given:
        return None
    found = None
    for key in keys:
        if hmac.compare_digest(given.encode(), key.encode()):
            found = key
    return found


def bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


Handler = Callable[[Request], Awaitable[Response]]


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def origin_middleware(keys: Sequence[str]) -> Callable[[Request, Handler], Awaitable[Response]]:
    async def check_origin(request: Request, call_next: Handler) -> Response:
        host = request.headers.get("host", "")
        if not keys and not is_loopback(host_name(host)):
            return _forbidden(f"Host {host!r} is not a loopback address")
        origin = request.headers.get("origin")
        if request.method not in SAFE_METHODS and origin and origin.split("://", 1)[-1] != host:
            return _forbidden(f"cross-origin {request.method} from {origin} refused")
        return await call_next(request)

    return check_origin


def host_name(host: str) -> str:
    """The name in a Host header: 'a:8000' -> 'a', '[::1]:8000' -> '[::1]'."""
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if ":" in host else host


def _forbidden(message: str) -> Response:
    return error_response(ApiError(403, message, type_="permission_error", code="forbidden"))


def key_middleware(
    keys: Sequence[str], admin_keys: Sequence[str] = ()
) -> Callable[[Request, Handler], Awaitable[Response]]:
    """Every request needs a key of `keys` (a tenant) or `admin_keys` (sees all tenants); the
    caller's Tenant is left in request.state.tenant (cli/http/tenants.py)."""
    every_key = [*keys, *admin_keys]

    async def check_key(request: Request, call_next: Handler) -> Response:
        if not every_key:
            return await call_next(request)
        query_key = request.query_params.get("key")
        if request.url.path == "/" and key_matches(query_key, every_key):
            response = RedirectResponse("/", status_code=303)  # the key leaves the address bar
            response.set_cookie(KEY_COOKIE, query_key or "", httponly=True, samesite="strict")
            return response
        key = matching_key(bearer(request), every_key) or matching_key(
            request.cookies.get(KEY_COOKIE), every_key
        )
        if key is not None:
            request.state.tenant = tenant_of(key, admin=key_matches(key, admin_keys))
            return await call_next(request)
        given = "an unknown key" if bearer(request) or query_key else "no key"
        error = ApiError(
            401,
            f"{given}: send 'Authorization: Bearer <key>' with one of RINGQ_API_KEYS "
            "or RINGQ_ADMIN_KEYS (the dashboard: open /?key=<key> once)",
            type_="authentication_error",
            code="invalid_api_key",
        )
        return error_response(error, headers={"WWW-Authenticate": "Bearer"})

    return check_key
