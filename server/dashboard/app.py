"""The dashboard's web app (Starlette): the page, its static files, a JSON API and a stream of
server-sent events, all read-only.

Routes (every other path is 404, every method but GET and HEAD 405)::

    GET /                          the page
    GET /static/{file}             its script and style sheet (package data, a fixed list)
    GET /api/snapshot              the run's snapshot (JSON)
    GET /api/metrics?since=N       metric rows from index N (JSON; at most 5000 per answer)
    GET /api/runs                  the other runs under the same root (JSON)
    GET /events                    server-sent events: an update every tick (~1 s)
    GET /runs/{name}[/api/...|/events]   the same for another run under the root

One :class:`Channel` per run shown encodes each tick's update once, whoever listens; a stream
only waits for its turn and writes those bytes, so a hundred open pages cost a hundred writes a
second, woken in ten groups so that no single burst holds the interpreter lock (which an
aggregator in the same process needs) for long. The client and peer tables ride along every
two seconds. Limits and the token are checked by :class:`Guard` before any route.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from murmura.server.dashboard.feeds import Feed, RunDirFeed
from murmura.server.dashboard.security import (
    COOKIE,
    MAX_QUERY_BYTES,
    MAX_SSE,
    DashboardError,
    cookie_value,
    host_allowed,
    resolve_run,
    token_matches,
)

log = logging.getLogger(__name__)

__all__ = ["Channel", "Guard", "Hub", "create_app", "with_tables"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Rows one /api/metrics answer holds at most (the page asks again from where it stopped).
MAX_ROWS_PER_ANSWER = 5000
#: Other runs kept open at once (each keeps its rows in memory); the least recent is dropped.
MAX_OPEN_RUNS = 8
#: Longest path accepted (414 beyond): run names are short.
MAX_PATH_BYTES = 512
#: Most header bytes a request may carry (431 beyond): a browser sends a few hundred.
MAX_HEADER_BYTES = 16 * 1024
#: A channel's streams are woken in this many groups, spread over STAGGER_SHARE of a tick:
#: a hundred streams written in one go would hold the interpreter lock for milliseconds at a
#: time, and an aggregator in the same process would wait for it (benchmarks/dashboard_load.py).
STAGGER_GROUPS = 10
STAGGER_SHARE = 0.3
#: An on-demand refresh (an API call) reads the files at most this often per run.
REFRESH_MIN_S = 0.2
#: The client and peer tables go out with an update at most this often (seconds); the updates
#: between carry the counters and chart rows only. A table is most of an update's bytes (a
#: few hundred per client) and is read more slowly than once a second.
TABLES_EVERY_S = 2.0
#: Rows of each table a stream carries (the page shows as many; /api/snapshot has them all).
STREAM_TABLE_ROWS = 500
STATIC_FILES = {"dashboard.js": "text/javascript; charset=utf-8",
                "dashboard.css": "text/css; charset=utf-8"}
SECURITY_HEADERS = [
    (b"content-security-policy",
     b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
     b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]


def _clean(value: Any) -> Any:
    """``value`` as strict JSON can hold it: non-finite floats become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _dumps(value: Any) -> bytes:
    """Strict JSON (a NaN from a client's profile would stop the page's JSON.parse): the
    encoder's fast path, and the cleaning walk only when it finds a non-finite float."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False, default=str).encode()
    except ValueError:
        return json.dumps(_clean(value), separators=(",", ":"), allow_nan=False,
                          default=str).encode()


def _sse(event: str, data: Any) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + _dumps(data) + b"\n\n"


def with_tables(snapshot: dict[str, Any]) -> dict[str, Any]:
    """``snapshot`` with its client and peer tables cut to what a page shows: those with
    refused updates first, then in the snapshot's order (the most recently active first)."""
    out = dict(snapshot)
    for key in ("clients", "peers"):
        table = snapshot.get(key)
        if isinstance(table, list):
            out[f"{key}_total"] = len(table)
            if len(table) > STREAM_TABLE_ROWS:
                table = sorted(table, key=lambda r: not (isinstance(r, dict)
                                                         and r.get("refusals")))
            out[key] = table[:STREAM_TABLE_ROWS]
    return out


class Channel:
    """One run's feed and the update its streams share."""

    def __init__(self, name: str, feed: Feed) -> None:
        self.name = name
        self.feed = feed
        self.listeners = 0
        self.message = b""
        self._sent = 0  # rows already sent in updates
        self._generation = feed.tail.generation
        self._next = [asyncio.Event() for _ in range(STAGGER_GROUPS)]
        self._joined = 0  # streams that ever joined: a stream's group is its number
        self._refreshed = 0.0
        self._tables_at = 0.0

    def refresh(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._refreshed >= REFRESH_MIN_S:
            self._refreshed = now
            self.feed.refresh()

    def tick(self, tick_s: float = 1.0) -> None:
        """Read the feed, encode the update once and wake every stream waiting for it."""
        self.refresh(force=True)
        tail = self.feed.tail
        if tail.generation != self._generation:
            self._generation, self._sent = tail.generation, 0
        start, rows = tail.since(self._sent)
        self._sent = tail.total
        snapshot, now = self.feed.snapshot(), time.monotonic()
        if now - self._tables_at >= TABLES_EVERY_S:
            self._tables_at = now
            snapshot = with_tables(snapshot)
        else:  # the counters and charts only; the page keeps the tables it has
            snapshot = {k: v for k, v in snapshot.items() if k not in ("clients", "peers")}
        self.message = _sse("update", {"snapshot": snapshot, "rows_from": start,
                                       "rows": rows, "rows_total": tail.total,
                                       "generation": tail.generation})
        self.wake(spread_s=STAGGER_SHARE * tick_s)

    def wake(self, *, spread_s: float = 0.0) -> None:
        """Hand the current message to every waiting stream: group k at k/STAGGER_GROUPS of
        ``spread_s`` from now (all at once without a spread)."""
        due, self._next = self._next, [asyncio.Event() for _ in range(STAGGER_GROUPS)]
        due[0].set()
        if spread_s <= 0:
            for event in due[1:]:
                event.set()
            return
        loop = asyncio.get_running_loop()
        for k, event in enumerate(due[1:], start=1):
            loop.call_later(spread_s * k / STAGGER_GROUPS, event.set)

    def group(self) -> int:
        """A new stream's wake-up group."""
        self._joined += 1
        return self._joined % STAGGER_GROUPS

    async def next_update(self, group: int) -> bytes:
        """The next tick's message, when ``group``'s turn comes (the ticks come while any
        stream is open, so a stream is never silent for long)."""
        event = self._next[group]
        await event.wait()
        return self.message


class Hub:
    """The channels: the main run's, and the other runs under ``runs_root`` opened by name."""

    def __init__(self, feed: Feed, *, runs_root: Path | None = None, tick_s: float = 1.0,
                 max_sse: int = MAX_SSE) -> None:
        self.main = Channel(feed.run_dir.name, feed)
        self.runs_root = runs_root
        self.tick_s = tick_s
        self.max_sse = max_sse
        self.streams = 0
        self.closing = False
        self._runs: OrderedDict[Path, Channel] = OrderedDict()

    def channel(self, name: str | None) -> Channel:
        """The main channel (``name`` None) or run ``name``'s. Raises DashboardError (400)
        or FileNotFoundError (404)."""
        if name is None:
            return self.main
        if self.runs_root is None:
            raise FileNotFoundError("this dashboard opens no other runs")
        path = resolve_run(self.runs_root, name)
        if path == self.main.feed.run_dir.resolve():
            return self.main
        channel = self._runs.get(path)
        if channel is None:
            channel = Channel(name, RunDirFeed(path))
            self._runs[path] = channel
            self._evict()
        self._runs.move_to_end(path)
        return channel

    def _evict(self) -> None:
        for path in list(self._runs):
            if len(self._runs) <= MAX_OPEN_RUNS:
                break
            if self._runs[path].listeners == 0:
                del self._runs[path]

    def list_runs(self, limit: int = 200) -> list[dict[str, Any]]:
        """The runs directly under the root, newest first."""
        if self.runs_root is None:
            return []
        found: list[dict[str, Any]] = []
        with contextlib.suppress(OSError):
            for child in self.runs_root.iterdir():
                metrics, summary = child / "metrics.jsonl", child / "summary.json"
                with contextlib.suppress(OSError):
                    if not child.is_dir() or child.is_symlink():
                        continue
                    times = [p.stat().st_mtime for p in (metrics, summary) if p.is_file()]
                    if times:
                        found.append({"name": child.name, "mtime": max(times),
                                      "finished": summary.is_file()})
        found.sort(key=lambda r: -float(r["mtime"]))
        return found[:limit]

    async def run(self) -> None:
        """Until cancelled: tick every channel that has a stream open."""
        while True:
            for channel in [self.main, *self._runs.values()]:
                if channel.listeners:
                    try:
                        channel.tick(self.tick_s)
                    except Exception:  # one unreadable run must not stop the others
                        log.exception("dashboard: reading %s failed", channel.name)
            await asyncio.sleep(self.tick_s)

    def close(self) -> None:
        """End every stream (at shutdown: a stream never ends by itself)."""
        self.closing = True
        for channel in [self.main, *self._runs.values()]:
            channel.wake()


def _page() -> bytes:
    return (resources.files("murmura.server.dashboard") / "static" / "index.html").read_bytes()


def _static(name: str) -> bytes:
    return (resources.files("murmura.server.dashboard") / "static" / name).read_bytes()


def create_app(feed: Feed, *, runs_root: str | Path | None = None, token: str = "",
               bound_host: str = "127.0.0.1", tls: bool = False, tick_s: float = 1.0,
               max_sse: int = MAX_SSE, max_query: int = MAX_QUERY_BYTES) -> Any:
    """The dashboard's ASGI app for ``feed``; ``runs_root`` is the directory whose other runs
    ``/runs/{name}`` opens (None: none). ``token`` (if set) is required on every request.
    The hub is ``app.state.hub``."""
    hub = Hub(feed, runs_root=Path(runs_root) if runs_root is not None else None,
              tick_s=tick_s, max_sse=max_sse)
    page = _page()
    static = {name: _static(name) for name in STATIC_FILES}

    def channel_of(request: Request) -> Channel:
        return hub.channel(request.path_params.get("name"))

    async def index(request: Request) -> Response:
        channel_of(request)  # /runs/NAME: 400 or 404 before the page, not after
        return Response(page, media_type="text/html; charset=utf-8")

    async def static_file(request: Request) -> Response:
        name = request.path_params["file"]
        if name not in static:
            return PlainTextResponse("no such file", status_code=404)
        return Response(static[name], media_type=STATIC_FILES[name])

    async def snapshot(request: Request) -> Response:
        channel = channel_of(request)
        channel.refresh()
        tail = channel.feed.tail
        return Response(_dumps({**channel.feed.snapshot(), "rows_total": tail.total,
                                "generation": tail.generation}),
                        media_type="application/json")

    async def metrics(request: Request) -> Response:
        channel = channel_of(request)
        since = _int_param(request, "since", 0)
        limit = min(_int_param(request, "limit", MAX_ROWS_PER_ANSWER), MAX_ROWS_PER_ANSWER)
        channel.refresh()
        tail = channel.feed.tail
        start, rows = tail.since(since)
        rows = rows[:limit]
        return Response(_dumps({"from": start, "rows": rows, "total": tail.total,
                                "generation": tail.generation}),
                        media_type="application/json")

    async def runs(request: Request) -> Response:
        return JSONResponse({"current": hub.main.name, "runs": hub.list_runs(),
                             "can_open": hub.runs_root is not None})

    async def events(request: Request) -> Response:
        channel = channel_of(request)
        if request.method == "HEAD":
            return Response(media_type="text/event-stream")
        if hub.streams >= hub.max_sse or hub.closing:
            return PlainTextResponse(f"too many open dashboard streams (at most "
                                     f"{hub.max_sse}); try again later", status_code=503,
                                     headers={"retry-after": "5"})
        if not channel.message:
            channel.tick(hub.tick_s)
        return _EventStream(hub, channel)

    routes = [Route(path, fn, methods=["GET", "HEAD"]) for path, fn in [
        ("/", index), ("/static/{file}", static_file), ("/api/snapshot", snapshot),
        ("/api/metrics", metrics), ("/api/runs", runs), ("/events", events),
        ("/runs/{name}", index), ("/runs/{name}/", index),
        ("/runs/{name}/api/snapshot", snapshot), ("/runs/{name}/api/metrics", metrics),
        ("/runs/{name}/events", events)]]

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        ticker = asyncio.create_task(hub.run())
        try:
            yield
        finally:
            hub.close()
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker

    async def bad_request(request: Request, exc: Exception) -> Response:
        return PlainTextResponse(str(exc), status_code=400)

    async def not_found(request: Request, exc: Exception) -> Response:
        text = str(exc) if isinstance(exc, FileNotFoundError) else "not found"
        return PlainTextResponse(text, status_code=404)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        DashboardError: bad_request, FileNotFoundError: not_found, 404: not_found})
    app.state.hub = hub
    return Guard(app, token=token, bound_host=bound_host, tls=tls, max_query=max_query,
                 hub=hub)


class _EventStream(StreamingResponse):
    """One page's stream of server-sent events: a hello (the snapshot now), then each tick's
    update as the channel encoded it. Counted against the hub's cap from the moment it is
    made until the connection ends, however it ends."""

    def __init__(self, hub: Hub, channel: Channel) -> None:
        hub.streams += 1
        channel.listeners += 1
        self.hub, self.channel = hub, channel
        super().__init__(self._events(), media_type="text/event-stream",
                         headers={"x-accel-buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)  # type: ignore[arg-type]
        finally:
            self.hub.streams -= 1
            self.channel.listeners -= 1

    async def _events(self) -> AsyncIterator[bytes]:
        hub, channel = self.hub, self.channel
        tail = channel.feed.tail
        yield b"retry: 2000\n" + _sse("hello", {
            "snapshot": with_tables(channel.feed.snapshot()), "rows_total": tail.total,
            "generation": tail.generation, "tick_s": hub.tick_s})
        group = channel.group()
        while not hub.closing:
            message = await channel.next_update(group)
            if hub.closing:
                break
            yield message


def _int_param(request: Request, name: str, default: int) -> int:
    text = request.query_params.get(name)
    if text is None:
        return default
    if not text.isdigit() or len(text) > 12:
        raise DashboardError(f"{name} must be a whole number >= 0")
    return int(text)


class Guard:
    """Checks every request before the app sees it: method, sizes, then the token (or, on a
    loopback dashboard without one, the Host header). Adds the security headers."""

    def __init__(self, app: ASGIApp, *, token: str, bound_host: str, tls: bool,
                 max_query: int, hub: Hub) -> None:
        self.app = app
        self.token = token
        self.bound_host = bound_host
        self.tls = tls
        self.max_query = max_query
        self.hub = hub

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # websocket: this app has none
            await send({"type": "websocket.close", "code": 1008})
            return
        refusal, set_cookie = self._check(scope)
        if refusal is not None:
            status, text, extra = refusal
            await _plain(send, status, text, extra)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", [])) + SECURITY_HEADERS
                if set_cookie:
                    headers.append((b"set-cookie", self._cookie()))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)

    def _check(self, scope: Scope) -> tuple[tuple[int, str, list[tuple[bytes, bytes]]] | None,
                                            bool]:
        if scope["method"] not in ("GET", "HEAD"):
            return (405, "the dashboard is read-only: GET only",
                    [(b"allow", b"GET, HEAD")]), False
        path, query = scope.get("raw_path") or scope["path"].encode(), scope["query_string"]
        if len(path) > MAX_PATH_BYTES:
            return (414, "path too long", []), False
        if len(query) > self.max_query:
            return (414, f"query string too long (at most {self.max_query} bytes)", []), False
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            return (431, "request headers too large", []), False
        headers = {}
        for key, value in scope["headers"]:
            if key in (b"authorization", b"cookie", b"host"):
                headers[key] = value.decode("latin-1")
        if not self.token:
            if not host_allowed(headers.get(b"host", ""), self.bound_host):
                return (421, "this dashboard answers to its loopback address only", []), False
            return None, False
        bearer = None
        auth = headers.get(b"authorization", "")
        if auth[:7].lower() == "bearer ":
            bearer = auth[7:].strip()
        given_query = None
        if b"token=" in query:
            values = parse_qs(query.decode("latin-1")).get("token")
            given_query = values[0] if values else None
        cookie = None
        if b"cookie" in headers:
            with contextlib.suppress(Exception):
                morsel = SimpleCookie(headers[b"cookie"]).get(COOKIE)
                cookie = morsel.value if morsel is not None else None
        if not token_matches(self.token, bearer=bearer, query=given_query, cookie=cookie):
            return (401, "this dashboard needs its token: an 'Authorization: Bearer TOKEN' "
                    "header, or open it once with ?token=TOKEN",
                    [(b"www-authenticate", b'Bearer realm="murmura dashboard"')]), False
        return None, given_query is not None

    def _cookie(self) -> bytes:
        secure = "; Secure" if self.tls else ""
        return (f"{COOKIE}={cookie_value(self.token)}; Path=/; HttpOnly; SameSite=Strict"
                f"{secure}").encode()


async def _plain(send: Send, status: int, text: str,
                 extra: list[tuple[bytes, bytes]]) -> None:
    body = text.encode() + b"\n"
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *extra,
                            *SECURITY_HEADERS]})
    await send({"type": "http.response.body", "body": body})
