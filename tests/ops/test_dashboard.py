"""The web dashboard over real sockets (uvicorn on 127.0.0.1:0): its JSON API and event stream,
the tail of a growing metrics file, a live aggregator's snapshots, and hostile input (path
traversal in run names, huge query strings, too many streams, a missing token off loopback).

The browser tests are in test_dashboard_browser.py (slow: a headless Chromium)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import math
import socket
import ssl
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette", reason="the dashboard needs the ops extra")
pytest.importorskip("uvicorn", reason="the dashboard needs the ops extra")

from murmura.server.dashboard import (  # noqa: E402
    BindPlan,
    DashboardError,
    DashboardServer,
    LiveFeed,
    MetricsTail,
    RunDirFeed,
    empty_snapshot,
    plan_bind,
)
from murmura.server.dashboard.feeds import snapshot_from_files  # noqa: E402
from murmura.server.dashboard.security import (  # noqa: E402
    cookie_value,
    host_allowed,
    resolve_run,
    token_matches,
)
from tests.conftest import wait_until  # noqa: E402

TOKEN = "s3cret-token-for-tests-0123456789"
SPEC_SIZE = 4


# -- helpers -----------------------------------------------------------------------------------


def write_rows(path: Path, rows: list[dict[str, Any]], *, mode: str = "a") -> None:
    with path.open(mode, encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def row(version: int, **extra: Any) -> dict[str, Any]:
    return {"version": version, "accuracy": 0.5 + version / 100, "loss": 1.0 / version,
            "time_s": float(version), "updates": 3 * version, "clients": 3,
            "refused_by_reason": {}, **extra}


def make_run(root: Path, name: str, versions: int = 3, *, finished: bool = False) -> Path:
    run = root / name
    run.mkdir(parents=True)
    write_rows(run / "metrics.jsonl", [row(v) for v in range(1, versions + 1)], mode="w")
    if finished:
        (run / "summary.json").write_text(json.dumps({
            "versions": versions, "config": {"server": {"mode": "async", "defense": "krum",
                                                        "train": {"codec": "int8"}}}}))
    return run


@pytest.fixture
def serve_dashboard() -> Iterator[Callable[..., DashboardServer]]:
    """serve_dashboard(feed, plan=None, **kw) -> a started dashboard; stopped at teardown."""
    running: list[DashboardServer] = []

    def start(feed: Any, plan: BindPlan | None = None, **kw: Any) -> DashboardServer:
        kw.setdefault("tick_s", 0.1)
        server = DashboardServer(feed, plan or plan_bind("127.0.0.1:0"), **kw).start()
        running.append(server)
        assert server.port != 0
        return server

    yield start
    for server in running:
        server.stop()


def get(server: DashboardServer, path: str, *, host: str = "127.0.0.1",
        headers: dict[str, str] | None = None,
        context: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], bytes]:
    if context is not None:
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, server.port, timeout=10, context=context)
    else:
        conn = http.client.HTTPConnection(host, server.port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def get_json(server: DashboardServer, path: str, **kw: Any) -> Any:
    status, _, body = get(server, path, **kw)
    assert status == 200, (status, body[:200])
    return json.loads(body)


def raw_request(port: int, target: bytes, *, host: str = "127.0.0.1", method: bytes = b"GET",
                headers: bytes = b"") -> tuple[int | None, bytes]:
    """One request sent byte for byte (no client-side normalisation of ``..``); the status
    (None if the server closed without answering) and the body's first bytes."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(method + b" " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers
                     + b"Connection: close\r\n\r\n")
        data = b""
        with contextlib.suppress(OSError):
            while len(data) < 1 << 16:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
    if not data.startswith(b"HTTP/1.1 "):
        return None, data
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


class EventStream:
    """A reader of one /events stream (http.client undoes the chunked encoding)."""

    def __init__(self, server: DashboardServer, path: str = "/events",
                 headers: dict[str, str] | None = None) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        self.conn.request("GET", path, headers=headers or {})
        self.resp = self.conn.getresponse()

    def next(self) -> tuple[str, Any]:
        event, data = "", list[str]()
        while True:
            line = self.resp.readline()
            if not line:
                raise EOFError("the stream ended")
            text = line.decode().rstrip("\r\n")
            if not text:
                if data:
                    return event, json.loads("".join(data))
                continue
            if text.startswith("event: "):
                event = text[7:]
            elif text.startswith("data: "):
                data.append(text[6:])

    def close(self) -> None:
        self.conn.close()


def non_loopback_address() -> str | None:
    """An address of this machine other than loopback (a UDP connect sends nothing)."""
    for probe in ("192.0.2.1", "10.255.255.255"):
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET,
                                                         socket.SOCK_DGRAM) as s:
            s.connect((probe, 9))
            address = s.getsockname()[0]
            if not address.startswith("127.") and address != "0.0.0.0":
                return str(address)
    return None


# -- the metrics tail and the snapshot from files ----------------------------------------------


def test_the_tail_reads_appended_rows_waits_for_a_torn_line_and_restarts_on_a_new_file(
        tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == 0 and tail.total == 0  # no file yet
    write_rows(path, [row(1), row(2)], mode="w")
    assert tail.read() == 2
    with path.open("a") as f:
        f.write(json.dumps(row(3))[:10])  # a row being written
    assert tail.read() == 0
    with path.open("a") as f:
        f.write(json.dumps(row(3))[10:] + "\n" + '{"version": 4, "loss": NaN}\n')
    assert tail.read() == 2
    assert [r["version"] for r in tail.rows] == [1, 2, 3, 4]
    assert tail.rows[-1]["loss"] is None  # strict JSON for the page

    write_rows(path, [row(1)], mode="w")  # a new run in the same directory
    tail.read()
    assert (tail.generation, tail.total) == (1, 1)


def test_the_tail_keeps_the_last_rows_and_says_where_they_start(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    write_rows(path, [row(v) for v in range(1, 11)], mode="w")
    tail = MetricsTail(path, max_rows=4)
    tail.read()
    start, rows = tail.since(0)
    assert (start, [r["version"] for r in rows]) == (6, [7, 8, 9, 10])
    assert tail.since(9)[0] == 9 and tail.since(99) == (10, [])


def test_a_run_directory_gives_the_live_snapshot_shape(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r", versions=2, finished=True)
    feed = RunDirFeed(run)
    feed.refresh()

    snap = feed.snapshot()

    assert set(snap) >= set(empty_snapshot())
    assert (snap["version"], snap["done"], snap["updates_total"]) == (2, True, 6)
    assert snap["run"] == {**snap["run"], "name": "r", "mode": "async", "rule": "krum"}
    assert snap["bytes_in_total"] == {"int8": 0} and snap["clients"] == []


def test_a_live_feed_serves_the_last_snapshot_posted_from_any_thread(tmp_path: Path) -> None:
    feed = LiveFeed(tmp_path)
    assert feed.snapshot()["source"] == "waiting"  # nothing posted yet
    posted = {**empty_snapshot(tmp_path), "version": 7}
    poster = threading.Thread(target=feed.post, args=(posted,))
    poster.start()
    poster.join()

    snap = feed.snapshot()

    assert (snap["version"], snap["source"]) == (7, "live") and snap["posted_s_ago"] >= 0
    assert "source" not in posted  # the posted dict is never changed


def test_a_gossip_run_is_a_peer_run() -> None:
    snap = snapshot_from_files(Path("g"), {"version": 3, "peers": 8, "consensus_distance": .5},
                               {"config": {"gossip": {"rule": "median"}}})
    assert (snap["role"], snap["run"]["mode"], snap["run"]["rule"]) == ("peer", "gossip",
                                                                        "median")
    assert snap["clients_active"] == 8


def test_a_stream_carries_the_refused_clients_first_and_at_most_a_page_of_them() -> None:
    from murmura.server.dashboard.app import STREAM_TABLE_ROWS, with_tables

    clients = [{"client_id": f"c{i}", "refusals": int(i == 900)} for i in range(1000)]
    snap = with_tables({**empty_snapshot(), "clients": clients})
    assert len(snap["clients"]) == STREAM_TABLE_ROWS and snap["clients_total"] == 1000
    assert [c["client_id"] for c in snap["clients"][:2]] == ["c900", "c0"]


# -- the rules ---------------------------------------------------------------------------------


def test_loopback_needs_nothing_and_any_other_address_needs_a_token_and_tls() -> None:
    assert plan_bind("127.0.0.1:0").loopback and plan_bind("localhost:8080").port == 8080
    assert plan_bind("[::1]:0").host == "::1"
    with pytest.raises(DashboardError, match="--dashboard-token"):
        plan_bind("0.0.0.0:8080")
    with pytest.raises(DashboardError, match="--tls-cert"):
        plan_bind("0.0.0.0:8080", token=TOKEN)
    with pytest.raises(DashboardError, match="at least 16"):
        plan_bind("0.0.0.0:8080", token="short", insecure=True)
    with pytest.raises(DashboardError, match="HOST:PORT"):
        plan_bind("nohost")
    plan = plan_bind("0.0.0.0:8080", token=TOKEN, insecure=True)
    assert (plan.token, plan.scheme) == (TOKEN, "http")
    assert plan_bind("0.0.0.0:0", token=TOKEN, tls_cert="c", tls_key="k").scheme == "https"


def test_the_token_is_accepted_in_each_form_and_nothing_else() -> None:
    assert token_matches(TOKEN, bearer=TOKEN) and token_matches(TOKEN, query=TOKEN)
    assert token_matches(TOKEN, cookie=cookie_value(TOKEN))
    assert not token_matches(TOKEN)
    assert not token_matches(TOKEN, bearer=TOKEN[:-1], query="x" * 5000, cookie=TOKEN)
    assert cookie_value(TOKEN) != TOKEN and TOKEN not in cookie_value(TOKEN)


@pytest.mark.parametrize("name", ["..", ".", "../x", "a/b", "a\\b", "..hidden", "a..b", "",
                                  "a\x00b", "x" * 200, "-rf", "~root"])
def test_a_run_name_that_is_not_one_plain_directory_name_is_refused(tmp_path: Path,
                                                                    name: str) -> None:
    with pytest.raises(DashboardError):
        resolve_run(tmp_path, name)


def test_only_direct_children_holding_a_run_open(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    make_run(root, "ok")
    (root / "empty").mkdir()
    outside = make_run(tmp_path, "outside")
    (root / "link").symlink_to(outside)
    assert resolve_run(root, "ok") == (root / "ok").resolve()
    for name in ("missing", "empty", "link"):
        with pytest.raises(FileNotFoundError):
            resolve_run(root, name)


def test_the_host_header_must_name_this_machine_without_a_token() -> None:
    for host in ("127.0.0.1:8080", "localhost", "LOCALHOST:1", "[::1]:80", "127.1.2.3"):
        assert host_allowed(host, "127.0.0.1"), host
    for host in ("evil.example", "evil.example:8080", "10.0.0.1", ""):
        assert not host_allowed(host, "127.0.0.1"), host


# -- the API over a real socket ----------------------------------------------------------------


def test_the_page_its_files_the_snapshot_and_the_rows(tmp_path: Path, serve_dashboard) -> None:
    run = make_run(tmp_path, "r", versions=5)
    server = serve_dashboard(RunDirFeed(run), runs_root=tmp_path)

    status, headers, page = get(server, "/")
    assert status == 200 and b"/static/dashboard.js" in page
    assert "script-src 'self'" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"
    for name, kind in (("dashboard.js", "javascript"), ("dashboard.css", "css")):
        status, headers, body = get(server, f"/static/{name}")
        assert status == 200 and kind in headers["content-type"] and body
    assert get(server, "/static/index.py")[0] == 404
    snap = get_json(server, "/api/snapshot")
    assert (snap["version"], snap["rows_total"], snap["source"]) == (5, 5, "files")
    rows = get_json(server, "/api/metrics?since=3")
    assert (rows["from"], [r["version"] for r in rows["rows"]], rows["total"]) == (3, [4, 5], 5)
    assert get_json(server, "/api/metrics?since=2&limit=1")["rows"] == [row(3)]
    assert get(server, "/api/metrics?since=-1")[0] == 400
    assert get(server, "/api/metrics?since=abc")[0] == 400
    assert get(server, "/nothing/here")[0] == 404
    assert get_json(server, "/api/runs")["runs"][0]["name"] == "r"


def test_a_client_that_sends_nan_cannot_break_the_pages_json(tmp_path: Path,
                                                              serve_dashboard) -> None:
    feed = LiveFeed(tmp_path)
    feed.post({**empty_snapshot(tmp_path), "clients": [
        {"client_id": "<script>x</script>", "steps_per_s": float("nan"), "weight": math.inf}]})
    server = serve_dashboard(feed)

    status, _, body = get(server, "/api/snapshot")

    def refuse(name: str) -> None:
        raise AssertionError(f"not strict JSON: {name}")

    client = json.loads(body, parse_constant=refuse)["clients"][0]
    assert client == {"client_id": "<script>x</script>", "steps_per_s": None, "weight": None}
    stream = EventStream(server)
    try:
        assert stream.next()[1]["snapshot"]["clients"][0]["steps_per_s"] is None
    finally:
        stream.close()


def test_it_is_read_only(tmp_path: Path, serve_dashboard) -> None:
    server = serve_dashboard(RunDirFeed(make_run(tmp_path, "r")))
    for method in (b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS"):
        status, _ = raw_request(server.port, b"/api/snapshot", method=method)
        assert status == 405, method


def test_the_event_stream_sends_the_rows_a_growing_run_appends(tmp_path: Path,
                                                               serve_dashboard) -> None:
    run = make_run(tmp_path, "r", versions=2)
    server = serve_dashboard(RunDirFeed(run))
    stream = EventStream(server)
    try:
        event, hello = stream.next()
        assert event == "hello" and hello["rows_total"] == 2
        write_rows(run / "metrics.jsonl", [row(3), row(4)])  # the run goes on
        seen: list[int] = []
        while len(seen) < 2:
            event, update = stream.next()
            assert event == "update"
            seen += [r["version"] for r in update["rows"]]
            assert update["snapshot"]["version"] == (seen[-1] if seen else 2)
        assert seen == [3, 4]
        assert server.hub.streams == 1
    finally:
        stream.close()
    wait_until(lambda: server.hub.streams == 0, what="the stream to be released")


def test_another_run_of_the_root_opens_by_name(tmp_path: Path, serve_dashboard) -> None:
    make_run(tmp_path, "main")
    make_run(tmp_path, "other.v2", versions=7, finished=True)
    server = serve_dashboard(RunDirFeed(tmp_path / "main"), runs_root=tmp_path)

    assert get(server, "/runs/other.v2")[0] == 200
    snap = get_json(server, "/runs/other.v2/api/snapshot")
    assert (snap["run"]["name"], snap["version"], snap["done"]) == ("other.v2", 7, True)
    assert len(get_json(server, "/runs/other.v2/api/metrics")["rows"]) == 7
    status, body = raw_request(server.port, b"/runs/nope/api/snapshot")
    assert status == 404 and b"no run 'nope'" in body


@pytest.mark.parametrize("target", [
    b"/runs/..", b"/runs/../api/snapshot", b"/runs/%2e%2e", b"/runs/%2E%2E/api/snapshot",
    b"/runs/..%2f..%2fetc%2fpasswd", b"/runs/..%5c..%5cetc", b"/runs/../../etc/passwd",
    b"/runs/%00", b"/runs/a%00b/api/metrics", b"/static/../app.py", b"/static/..%2fapp.py",
    b"/runs/" + b"%2e" * 300, b"//etc/passwd", b"/runs/~root/api/snapshot",
])
def test_path_traversal_in_a_run_name_is_refused(tmp_path: Path, serve_dashboard,
                                                 target: bytes) -> None:
    root = tmp_path / "runs"
    make_run(root, "main")
    (tmp_path / "secret.txt").write_text("TOP SECRET")
    server = serve_dashboard(RunDirFeed(root / "main"), runs_root=root)

    status, body = raw_request(server.port, target)

    assert status in (400, 404, 414), (status, body[:200])
    assert b"TOP SECRET" not in body and b"root:" not in body


@pytest.mark.parametrize("size", [2_000, 60_000, 1_000_000])
def test_a_huge_query_string_is_refused_and_the_server_goes_on(tmp_path: Path, serve_dashboard,
                                                               size: int) -> None:
    server = serve_dashboard(RunDirFeed(make_run(tmp_path, "r")))

    status, _ = raw_request(server.port, b"/api/metrics?since=" + b"9" * size)

    assert status in (400, 414, 431, None)  # None: h11 hangs up on a request line past 16 KB
    assert status != 200
    assert get_json(server, "/api/snapshot")["version"] == 3


def test_huge_headers_are_refused(tmp_path: Path, serve_dashboard) -> None:
    server = serve_dashboard(RunDirFeed(make_run(tmp_path, "r")))
    status, _ = raw_request(server.port, b"/", headers=b"X-Big: " + b"a" * 40_000 + b"\r\n")
    assert status == 431
    many = b"".join(b"X-%d: %s\r\n" % (i, b"b" * 100) for i in range(400))
    assert raw_request(server.port, b"/", headers=many)[0] == 431


def test_streams_beyond_the_cap_are_refused_with_503(tmp_path: Path, serve_dashboard) -> None:
    server = serve_dashboard(RunDirFeed(make_run(tmp_path, "r")), max_sse=200)

    async def open_streams(n: int) -> list[int]:
        async def one() -> tuple[int, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await writer.drain()
            status = int((await asyncio.wait_for(reader.readline(), 30)).split()[1])
            return status, writer

        opened = await asyncio.gather(*(one() for _ in range(n)))
        statuses = [status for status, _ in opened]
        assert server.hub.streams == 200
        for _, writer in opened:
            writer.close()
        return statuses

    statuses = asyncio.run(open_streams(250))

    assert statuses.count(200) == 200 and statuses.count(503) == 50
    assert get_json(server, "/api/snapshot")["version"] == 3  # still answering
    wait_until(lambda: server.hub.streams == 0, what="every stream to be released")


# -- the token, off loopback -------------------------------------------------------------------


def test_off_loopback_every_request_needs_the_token(tmp_path: Path, serve_dashboard) -> None:
    address = non_loopback_address() or "0.0.0.0"
    server = serve_dashboard(RunDirFeed(make_run(tmp_path, "r")),
                             plan_bind(f"{address}:0", token=TOKEN, insecure=True))
    host = address if address != "0.0.0.0" else "127.0.0.1"

    for path in ("/", "/api/snapshot", "/events", "/static/dashboard.js"):
        status, headers, body = get(server, path, host=host)
        assert status == 401, path
        assert "bearer" in headers["www-authenticate"].lower() and b"token" in body
    assert get(server, "/api/snapshot", host=host,
               headers={"Authorization": "Bearer wrong-token-wrong-token"})[0] == 401
    assert get(server, "/api/snapshot", host=host, headers={"Cookie": f"murmura_dashboard="
                                                            f"{TOKEN}"})[0] == 401
    assert get(server, "/api/snapshot", host=host,
               headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
    status, headers, _ = get(server, f"/?token={TOKEN}", host=host)  # once, then a cookie
    assert status == 200
    cookie = headers["set-cookie"].split(";")[0]
    assert TOKEN not in cookie and "HttpOnly" in headers["set-cookie"]
    assert get(server, "/api/snapshot", host=host, headers={"Cookie": cookie})[0] == 200


def test_tls_serves_with_the_servers_certificate(tmp_path: Path, serve_dashboard,
                                                 pki: dict[str, Path]) -> None:
    plan = plan_bind("0.0.0.0:0", token=TOKEN, tls_cert=str(pki["cert"]), tls_key=str(pki["key"]))
    server = serve_dashboard(RunDirFeed(make_run(tmp_path, "r")), plan)
    context = ssl.create_default_context(cafile=str(pki["ca"]))

    assert server.url.startswith("https://")
    assert get(server, "/api/snapshot", context=context)[0] == 401
    assert get(server, "/api/snapshot", context=context,
               headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
    status, headers, _ = get(server, f"/?token={TOKEN}", context=context)
    assert status == 200 and "Secure" in headers["set-cookie"]
    with pytest.raises(OSError):  # no plain HTTP on the TLS port
        get(server, "/api/snapshot")


def test_a_loopback_dashboard_refuses_a_foreign_host_header(tmp_path: Path,
                                                            serve_dashboard) -> None:
    server = serve_dashboard(RunDirFeed(make_run(tmp_path, "r")))
    assert get(server, "/api/snapshot", headers={"Host": "evil.example"})[0] == 421
    assert get(server, "/api/snapshot", headers={"Host": f"localhost:{server.port}"})[0] == 200


# -- beside a live aggregator ------------------------------------------------------------------


def _evaluate(params: np.ndarray) -> dict[str, float]:
    s = float(np.abs(params).sum())
    return {"accuracy": 0.1 + 0.85 * (1 - math.exp(-s)), "loss": 2.3 * math.exp(-s) + 0.05}


class Federation:
    """A real loopback aggregator (a 4-value model, async rounds) with client threads pushing
    over gRPC: honest ones push small updates every ``period_s``; ``bad`` ones push a payload
    of the wrong size, refused when decoded (and counted against them)."""

    DEVICES = (("cuda", "RTX 4090", 310.0), ("cpu", "x86_64", 42.0), ("mps", "Apple M2", 120.0))

    def __init__(self, out: Path, *, honest: int = 3, bad: int = 1, period_s: float = 0.3,
                 max_versions: int = 1000, buffer_size: int = 2, workers: int = 0) -> None:
        from murmura.protocols import ModelSpec, TensorSpec
        from murmura.server import AggregatorCore, RunRecorder, ServerConfig, ServerThread

        config = ServerConfig.from_flat(
            mode="async", buffer_size=buffer_size, min_clients=1, max_versions=max_versions,
            max_staleness=50, require_identity=False, push_per_s=0.0, join_per_s=0.0,
            workers=workers)
        self.core = AggregatorCore(config, ModelSpec((TensorSpec("w", (SPEC_SIZE,)),)),
                                   np.zeros(SPEC_SIZE, np.float32), evaluator=_evaluate,
                                   recorder=RunRecorder(out, config={"server": config.table()}))
        self.srv = ServerThread(self.core, "127.0.0.1:0").start()
        self.stop = threading.Event()
        self.refused = 0
        self.threads = [threading.Thread(target=self._client, args=(i, i >= honest, period_s),
                                         daemon=True) for i in range(honest + bad)]

    def start_clients(self) -> Federation:
        for t in self.threads:
            t.start()
        return self

    def _client(self, index: int, bad: bool, period_s: float) -> None:
        from murmura.client import GrpcTransport, RemoteError
        from murmura.protocols import Action, DeviceProfile, UpdateHeader

        device, name, speed = self.DEVICES[index % len(self.DEVICES)]
        rng = np.random.default_rng(index)
        transport = GrpcTransport(self.srv.address, timeout_s=10)
        try:
            joined, spec = transport.join(f"{'bad' if bad else 'client'}-{index:02d}",
                                          DeviceProfile(device=device, device_name=name,
                                                        steps_per_s=speed * (1 + index / 10)))
            fingerprint = spec.fingerprint()
            while not self.stop.is_set():
                task = transport.task(joined.session, 0.0)
                if task.action == Action.STOP:
                    return
                values = [1.0] * (SPEC_SIZE - 1) if bad else \
                    list(0.02 * (1 + rng.random(SPEC_SIZE)))
                payload = np.asarray(values, "<f4").tobytes()
                header = UpdateHeader(session=joined.session, update_id=uuid.uuid4().hex,
                                      base_version=task.version, round=task.round,
                                      num_examples=10, codec="dense-f32",
                                      payload_bytes=len(payload), spec_fingerprint=fingerprint)
                try:
                    transport.push(header, payload)
                except RemoteError:
                    self.refused += 1
                self.stop.wait(period_s * (1 + 0.5 * rng.random()))
        except Exception:
            if not self.stop.is_set():
                raise
        finally:
            transport.close()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            if t.is_alive():
                t.join(15)
        self.srv.stop(grace=None)


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[Callable[..., Federation]]:
    started: list[Federation] = []

    def start(**kw: Any) -> Federation:
        fed = Federation(tmp_path / "runs" / "live", **kw)
        started.append(fed)
        return fed

    yield start
    for fed in started:
        fed.close()


@pytest.mark.integration
def test_a_live_aggregator_posts_its_telemetry_and_the_stream_follows_it(
        federation, serve_dashboard) -> None:
    from murmura.dashboard import start_live

    fed = federation(honest=2, bad=1)
    live = start_live(plan_bind("127.0.0.1:0"), fed.core, fed.core.recorder.out_dir,
                      call=fed.srv.call)
    try:
        fed.start_clients()
        stream = EventStream(live.server)
        event, hello = stream.next()
        assert event == "hello" and hello["snapshot"]["source"] == "live"
        versions: list[int] = []
        snap: dict[str, Any] = {}
        clients = hello["snapshot"]["clients"]
        while len(versions) < 3 or not any(c["refusals"] for c in clients):
            event, update = stream.next()
            snap = update["snapshot"]
            clients = snap.get("clients", clients)  # the tables come every 2 s
            versions += [r["version"] for r in update["rows"]]
        stream.close()
        assert versions == sorted(versions) and len(set(versions)) == len(versions)
        bad = [c for c in clients if c["refusals"]]
        assert [c["client_id"] for c in bad] == ["bad-02"]
        assert "INVALID_ARGUMENT: payload does not decode" in snap["refused_total"]
        assert snap["run"]["name"] == "live" and snap["role"] == "server"
    finally:
        fed.srv.call(live.cancel_poster)
        live.stop()
