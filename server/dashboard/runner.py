"""Serving the dashboard from its own thread and event loop (uvicorn), beside whatever else the
process runs: a gRPC aggregator's loop is never shared, so a slow page cannot slow an RPC."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from pathlib import Path
from typing import Any

from murmura.server.dashboard.feeds import Feed
from murmura.server.dashboard.security import MAX_QUERY_BYTES, MAX_SSE, BindPlan

log = logging.getLogger(__name__)

__all__ = ["DashboardServer", "missing_dependency"]

#: Connections uvicorn serves at once beyond the event streams (page loads, API calls); more
#: are answered 503 by uvicorn itself before the app runs.
SPARE_CONNECTIONS = 64


def missing_dependency() -> str | None:
    """The name of the optional package the dashboard lacks, or None when it can run."""
    for name in ("starlette", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            return name
    return None


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free one; read back from the socket)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class DashboardServer:
    """The dashboard app for ``feed`` on ``plan``'s address, in a daemon thread.

    ``start()`` returns once the socket is bound and the app is serving (:attr:`url` then
    names the bound port); ``stop()`` ends the streams and the thread.
    """

    def __init__(self, feed: Feed, plan: BindPlan, *, runs_root: str | Path | None = None,
                 tick_s: float = 1.0, max_sse: int = MAX_SSE,
                 max_query: int = MAX_QUERY_BYTES) -> None:
        from murmura.server.dashboard.app import create_app

        self.plan = plan
        self.feed = feed
        self.app = create_app(feed, runs_root=runs_root, token=plan.token,
                              bound_host=plan.host, tls=bool(plan.tls_cert), tick_s=tick_s,
                              max_sse=max_sse, max_query=max_query)
        self.max_sse = max_sse
        self.port = 0
        self._server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def hub(self) -> Any:
        return self.app.hub

    @property
    def url(self) -> str:
        host = self.plan.host
        shown = f"[{host}]" if ":" in host else host
        return f"{self.plan.scheme}://{shown}:{self.port}/"

    def start(self, timeout: float = 30.0) -> DashboardServer:
        import uvicorn

        sock = _bind(self.plan.host, self.plan.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_config=None, log_level="warning", access_log=False, http="h11",
            ws="none", lifespan="on", proxy_headers=False, server_header=False,
            limit_concurrency=self.max_sse + SPARE_CONNECTIONS, timeout_keep_alive=5,
            timeout_graceful_shutdown=2, h11_max_incomplete_event_size=16 * 1024,
            ssl_certfile=self.plan.tls_cert or None, ssl_keyfile=self.plan.tls_key or None)
        server = uvicorn.Server(config)
        self._server = server

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(server.serve(sockets=[sock]))
            except BaseException as exc:  # reported by start() or stop()
                self._error = exc
            finally:
                sock.close()
                loop.close()

        self._thread = threading.Thread(target=serve, name="murmura-dashboard", daemon=True)
        self._thread.start()
        waited = 0.0
        while not server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the dashboard did not start: {self._error!r}")
            if waited >= timeout:
                self.stop()
                raise RuntimeError("the dashboard did not start in time")
            self._thread.join(0.02)
            waited += 0.02
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """End every stream, then the server and its thread."""
        loop, server = self._loop, self._server
        if loop is not None and server is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self.hub.close)
            except RuntimeError:  # the loop closed meanwhile
                pass
            server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("dashboard thread did not stop within %.0f s", timeout)

    def __enter__(self) -> DashboardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
