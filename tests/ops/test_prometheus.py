"""The Prometheus endpoint, scraped over HTTP while real servers, clients and peers run on
loopback: every documented metric is there, the figures agree with metrics.jsonl at the same
version, no label holds a client id, and hostile requests leave the run alone."""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("prometheus_client", reason="metrics need the ops extra: "
                    "pip install 'murmura[ops]'")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from murmura.cli import main  # noqa: E402
from murmura.client import GrpcTransport, RemoteError  # noqa: E402
from murmura.protocols import (  # noqa: E402
    DeviceProfile,
    ModelSpec,
    TensorSpec,
    UpdateHeader,
)
from murmura.server import AggregatorCore, ServerConfig, ServerThread  # noqa: E402
from murmura.server.app import assemble_core  # noqa: E402
from murmura.server.outputs import read_rows  # noqa: E402
from murmura.server.prometheus import MetricsEndpoint, serve_metrics  # noqa: E402
from tests.conftest import wait_until  # noqa: E402

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
SPEC = ModelSpec((TensorSpec("w", (4,)),))
METHODS = {"Join", "Challenge", "GetTask", "Pull", "Push", "Leave"}


def documented(role: str) -> set[str]:
    """The metric names docs/operations.md lists for ``role`` (server, peer or dp)."""
    names = set()
    for line in DOCS.read_text().splitlines():
        m = re.match(r"\| `(murmura_\w+)` \|[^|]*\|[^|]*\| (\w+) \|", line)
        if m and m.group(2) in (role, "both"):
            names.add(m.group(1))
    assert len(names) > 2, "the metrics table of docs/operations.md was not found"
    return names


class Scrape:
    """One scrape, parsed: sample values by (name, labels), and the family names."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
        self.samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, tuple(sorted(labels.items())))]

    def labelled(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {labels: v for (n, labels), v in self.samples.items() if n == name}

    def has(self, name: str) -> bool:
        return name in self.families or any(n == name for n, _ in self.samples)

    def label_values(self) -> set[str]:
        return {v for _, labels in self.samples for _, v in labels}


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        return Scrape(reply.read().decode())


def header(session: str, payload: bytes, *, version: int, round_: int = 0) -> UpdateHeader:
    return UpdateHeader(session=session, update_id=uuid.uuid4().hex, base_version=version,
                        round=round_, num_examples=5, codec="dense-f32",
                        payload_bytes=len(payload), spec_fingerprint=SPEC.fingerprint())


def evaluate(params: np.ndarray) -> dict[str, float]:
    """A real evaluator of the 4-value model: its accuracy and loss move with the model."""
    return {"accuracy": float(np.tanh(np.abs(params).sum())), "loss": float(np.abs(params).mean())}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Callable[..., tuple[AggregatorCore, ServerThread,
                                                             MetricsEndpoint]]]:
    """served(**flat) -> (core, server, endpoint): a loopback server writing its run to
    tmp_path/run, with a metrics endpoint on a free port; all stopped at teardown."""
    started: list[tuple[ServerThread, MetricsEndpoint]] = []

    def start(min_interval_s: float = 0.0, **flat: Any) -> tuple[AggregatorCore, ServerThread,
                                                                  MetricsEndpoint]:
        cfg = {"min_clients": 2, "max_versions": 3, "require_identity": False, "workers": 0,
               **flat}
        core = assemble_core(ServerConfig.from_flat(**cfg), SPEC, np.zeros(4, np.float32),
                             out_dir=tmp_path / "run", evaluator=evaluate)
        srv = ServerThread(core, "127.0.0.1:0").start()
        endpoint = serve_metrics(core.telemetry, "127.0.0.1:0", min_interval_s=min_interval_s)
        started.append((srv, endpoint))
        return core, srv, endpoint

    yield start
    for srv, endpoint in started:
        endpoint.stop()
        srv.stop(grace=None)


def test_every_documented_metric_agrees_with_metrics_jsonl_at_each_version(
        served, tmp_path: Path) -> None:
    core, srv, endpoint = served()
    t = GrpcTransport(srv.address, timeout_s=10)
    clients = [t.join(f"client-{name}", DeviceProfile(device="cpu", steps_per_s=3.0))[0]
               for name in ("a", "b")]
    ones = np.ones(4, "<f4").tobytes()
    try:
        for v in range(1, 4):
            for c in clients:
                task = t.task(c.session, 5)
                assert task.action.name == "TRAIN"
                if v == 2 and c is clients[0]:  # a wrong-size update is refused
                    short = b"\0" * 8
                    with pytest.raises(RemoteError) as refused:
                        t.push(header(c.session, short, version=task.version,
                                      round_=task.round), short)
                    assert refused.value.status == "INVALID_ARGUMENT"
                t.push(header(c.session, ones, version=task.version, round_=task.round), ones)
            m = scrape(endpoint.url)  # the push that completed version v answered after it
            row = {r["version"]: r for r in read_rows(tmp_path / "run" / "metrics.jsonl")}[v]

            assert m.value("murmura_model_version") == row["version"] == v
            assert m.value("murmura_updates_accepted_total") == row["updates"] == 2 * v
            assert m.value("murmura_versions_published_total") == v
            assert m.value("murmura_test_accuracy") == pytest.approx(row["accuracy"])
            assert m.value("murmura_test_loss") == pytest.approx(row["loss"])
            refused_now = {f"{dict(k)['status']}: {dict(k)['reason']}": n
                           for k, n in m.labelled("murmura_requests_refused_total").items()}
            assert refused_now == row["refused_by_reason"]
            assert m.value("murmura_clients_active") == row["clients"] == 2
        assert refused_now == {"INVALID_ARGUMENT: payload does not decode": 1}
        assert m.value("murmura_run_finished") == 1
        assert sum(m.labelled("murmura_bytes_received_total").values()) == \
            srv.call(lambda: core.traffic.bytes_up)
        assert m.value("murmura_update_staleness_versions_count") == 6
        assert m.value("murmura_update_staleness_versions_bucket", le="0") == 6
        methods = {dict(k)["method"] for k in m.labelled("murmura_rpc_duration_seconds_count")}
        assert {"Join", "GetTask", "Push"} <= methods <= METHODS
        missing = sorted(n for n in documented("server") if not m.has(n))
        assert not missing, f"documented but not served: {missing}"
        # no label value names a client, a session or anything a client chose
        ids = {"client-a", "client-b", *(c.session for c in clients)}
        assert not ids & m.label_values()
        assert m.labelled("murmura_run_info") == {(("mode", "sync"), ("name", "run"),
                                                   ("role", "server"), ("rule", "fedavg")): 1.0}
        assert not m.has("murmura_dp_epsilon_spent")  # no differential privacy in this run
    finally:
        t.close()


def test_a_refusal_that_names_its_client_does_not_put_the_id_in_a_label(
        served, tmp_path: Path) -> None:
    from murmura.protocols.identity import NodeKey

    allowed, stranger = NodeKey.from_seed("allowed"), NodeKey.from_seed("stranger")
    keys = tmp_path / "allowed.txt"
    keys.write_text(allowed.public_bytes.hex() + "\n")
    core, srv, endpoint = served(require_identity=True, allowed_keys=str(keys))
    t = GrpcTransport(srv.address, timeout_s=10)
    try:
        with pytest.raises(RemoteError) as refused:
            t.join_as(stranger, DeviceProfile())
        assert refused.value.status == "PERMISSION_DENIED"
        assert stranger.client_id in refused.value.message  # the client is told who it is
        t.join_as(allowed, DeviceProfile())
    finally:
        t.close()

    m = scrape(endpoint.url)

    refusals = m.labelled("murmura_requests_refused_total")
    assert sum(refusals.values()) == 1
    assert stranger.client_id in json.dumps(srv.call(lambda: core.traffic.refused_by_reason))
    assert not {stranger.client_id, allowed.client_id} & m.label_values()
    assert not any(stranger.client_id in v for v in m.label_values())


def test_the_privacy_budget_spent_is_served_when_dp_is_on(served, tmp_path: Path) -> None:
    pytest.importorskip("dp_accounting", reason="differential privacy needs the privacy extra")
    core, srv, endpoint = served(dp_clip=1.0, dp_noise_multiplier=1.5, max_versions=2)
    t = GrpcTransport(srv.address, timeout_s=10)
    sessions = [t.join(f"client-{i}", DeviceProfile())[0].session for i in range(2)]
    ones = np.ones(4, "<f4").tobytes()
    try:
        for v in (1, 2):
            for s in sessions:
                task = t.task(s, 5)
                t.push(header(s, ones, version=task.version, round_=task.round), ones)
            m = scrape(endpoint.url)
            row = {r["version"]: r for r in read_rows(tmp_path / "run" / "metrics.jsonl")}[v]
            assert m.value("murmura_dp_epsilon_spent") == pytest.approx(row["dp_epsilon"])
            assert m.value("murmura_dp_delta") == row["dp_delta"]
    finally:
        t.close()
    assert 0 < m.value("murmura_dp_epsilon_spent") < float("inf")
    missing = sorted(n for n in documented("dp") if not m.has(n))
    assert not missing, f"documented but not served: {missing}"


def test_a_real_run_is_scraped_while_it_runs(tmp_path: Path) -> None:
    """Digits clients train against a server with a worker process; a scraper polls the
    endpoint all along; what it saw only moves forward and ends on the last row."""
    import torch

    from murmura.client import ClientRuntime, TorchTrainer
    from murmura.protocols.identity import NodeKey
    from murmura.server import build_core
    from murmura.tasks import TaskConfig, load_task

    torch.set_num_threads(1)
    task_config = TaskConfig()
    task = load_task(task_config)
    core = build_core(ServerConfig.from_flat(mode="async", buffer_size=3, min_clients=3,
                                             max_versions=5, workers=1),
                      task_config, out_dir=tmp_path / "digits", task=task)
    seen: list[tuple[float, float]] = []
    stop = threading.Event()

    with ServerThread(core, "127.0.0.1:0") as srv, \
            serve_metrics(core.telemetry, "127.0.0.1:0") as endpoint:
        def scraper() -> None:
            while not stop.is_set():
                m = scrape(endpoint.url)
                seen.append((m.value("murmura_model_version"),
                             m.value("murmura_updates_accepted_total")))
                stop.wait(0.05)

        def client(i: int) -> None:
            trainer = TorchTrainer(task.build_model(), task.client_data(i, 3), device="cpu")
            ClientRuntime(GrpcTransport(srv.address, timeout_s=30), trainer,
                          identity=NodeKey.from_seed(f"client-{i:03d}")).run()

        poller = threading.Thread(target=scraper)
        poller.start()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for th in threads:
            th.start()
        try:
            assert srv.wait_done(timeout=120)
        finally:
            for th in threads:
                th.join(timeout=60)
            stop.set()
            poller.join(timeout=30)
        time.sleep(0.6)  # past the sampler's interval: a fresh sample
        final = scrape(endpoint.url)
        client_ids = set(srv.call(lambda: list(core.telemetry.clients)))

    rows = read_rows(tmp_path / "digits" / "metrics.jsonl")
    by_version = {r["version"]: r for r in rows}
    assert len(seen) > 3
    assert seen == sorted(seen)  # versions and updates only move forward
    for version, updates in seen:
        if version:
            assert updates >= by_version[int(version)]["updates"]
    last = rows[-1]
    assert final.value("murmura_model_version") == last["version"] == 5
    assert final.value("murmura_updates_accepted_total") == last["updates"]
    assert final.value("murmura_test_accuracy") == pytest.approx(last["accuracy"])
    assert final.value("murmura_tier_cold_starts_total") >= 1
    assert final.value("murmura_update_staleness_versions_count") == last["updates"]
    assert len(client_ids) == 3 and not client_ids & final.label_values()


def _get(port: int, target: str, method: str = "GET") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request(method, target)
        reply = conn.getresponse()
        reply.read()
        return reply.status
    finally:
        conn.close()


def test_hostile_requests_are_answered_or_refused_and_the_run_goes_on(served) -> None:
    core, srv, endpoint = served(min_interval_s=0.5, mode="async", buffer_size=1,
                                 min_clients=1, max_versions=10)
    t = GrpcTransport(srv.address, timeout_s=10)
    a, _ = t.join("client-a", DeviceProfile())
    ones = np.ones(4, "<f4").tobytes()

    def push() -> int:
        version = srv.call(lambda: core.version)
        return t.push(header(a.session, ones, version=version), ones).version

    idle = [socket.create_connection(("127.0.0.1", endpoint.port), timeout=5)
            for _ in range(4)]  # connections that never send a request
    try:
        assert push() == 1
        assert _get(endpoint.port, "/metrics?" + "x=" + "A" * 100_000) in (400, 414)
        assert _get(endpoint.port, "/metrics?" + "name[]=a&" * 500) == 414
        assert _get(endpoint.port, "/../../etc/passwd") == 404
        assert _get(endpoint.port, "/metrics/../../../etc/passwd") == 404
        assert _get(endpoint.port, "/metrics", method="POST") == 405
        with ThreadPoolExecutor(50) as pool:
            scrapes = pool.map(lambda _: _get(endpoint.port, "/metrics"), range(50))
            pushed = push()  # pushes go on while 50 scrapes come at once
            statuses = list(scrapes)
        assert set(statuses) <= {200, 503} and statuses.count(200) >= 1
        assert pushed == 2
        assert push() == 3
        m = scrape(endpoint.url)
        wait_until(lambda: scrape(endpoint.url).value("murmura_model_version") == 3,
                   what="a fresh sample")
        assert m.has("murmura_rpc_duration_seconds")
    finally:
        for s in idle:
            s.close()
        t.close()


def test_a_port_in_use_fails_at_once_with_the_flag_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match="--metrics-address: cannot listen"):
            MetricsEndpoint(f"127.0.0.1:{port}")


@pytest.mark.parametrize("command", [
    ["server", "--out", "{out}"], ["run", "--out", "{out}"], ["peer"]])
def test_without_prometheus_client_the_flag_fails_in_one_line(
        command: list[str], tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    argv = [a.replace("{out}", str(tmp_path / "out")) for a in command]

    code = main([*argv, "--metrics-address", "127.0.0.1:0"])

    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and 'pip install "murmura[ops]"' in err
    assert not (tmp_path / "out").exists()


def test_a_malformed_metrics_address_is_a_usage_error(capsys) -> None:
    assert main(["server", "--metrics-address", "localhost"]) == 2
    assert "must be HOST:PORT" in capsys.readouterr().err


def _lines(stream: Any, sink: list[str]) -> threading.Thread:
    def read() -> None:
        for line in stream:
            sink.append(line)
    th = threading.Thread(target=read, daemon=True)
    th.start()
    return th


def test_murmura_server_serves_metrics_and_marks_its_run_directory(tmp_path: Path,
                                                                   capsys) -> None:
    out = tmp_path / "runs" / "prod"
    server = subprocess.Popen(
        [sys.executable, "-m", "murmura", "server", "--address", "127.0.0.1:0",
         "--metrics-address", "127.0.0.1:0", "--out", str(out), "--min-clients", "1",
         "--max-versions", "1", "--no-require-identity", "--workers", "0", "--linger-s",
         "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout: list[str] = []
    stderr: list[str] = []
    readers = [_lines(server.stdout, stdout), _lines(server.stderr, stderr)]
    try:
        wait_until(lambda: any("Prometheus metrics on" in line for line in stderr)
                   or server.poll() is not None, 120, "the metrics line")
        url = next(line for line in stderr if "Prometheus metrics on" in line).split()[-1]
        address = next(line for line in stdout if "listening on" in line).split()[-1]
        pid = json.loads((out / "murmura.pid").read_text())
        assert pid["pid"] == server.pid and pid["metrics"] == url
        assert pid["address"] == address and pid["mode"] == "sync"
        assert main(["runs", str(tmp_path / "runs"), "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [(r["name"], r["state"], r["command"]) for r in listed] == \
            [("prod", "running", "server")]
        assert scrape(url).value("murmura_model_version") == 0

        t = GrpcTransport(address, timeout_s=10)
        a, spec = t.join("client-a", DeviceProfile())
        task = t.task(a.session, 10)
        payload = np.full(spec.size, 0.01, "<f4").tobytes()
        t.push(UpdateHeader(session=a.session, update_id="u1", base_version=task.version,
                            round=task.round, num_examples=3, codec="dense-f32",
                            payload_bytes=len(payload), spec_fingerprint=spec.fingerprint()),
               payload)
        t.close()
        assert server.wait(60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        for r in readers:
            r.join(timeout=10)

    assert not (out / "murmura.pid").exists()
    assert main(["runs", str(tmp_path / "runs"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["state"], r["versions"]) for r in listed] == [("prod", "finished", 1)]


def test_a_gossip_peer_serves_its_metrics() -> None:
    import torch

    from murmura.client import TorchTrainer
    from murmura.gossip import GossipConfig, GrpcPeerTransport, PeerRuntime
    from murmura.gossip.prometheus import PeerCollector, peer_snapshot
    from murmura.tasks import ArrayDataset
    from tests.ops.test_telemetry import TOP_KEYS

    def runtime(peer_id: str, bootstrap: list[str]) -> PeerRuntime:
        torch.manual_seed(0)
        data = ArrayDataset(np.zeros((8, 4), np.float32), np.zeros(8, np.int64))
        trainer = TorchTrainer(torch.nn.Linear(4, 2), data, device="cpu")
        return PeerRuntime(GrpcPeerTransport("127.0.0.1:0", timeout_s=5), trainer,
                           peer_id=peer_id, bootstrap=bootstrap,
                           config=GossipConfig(rounds=2, min_peers=2, round_timeout_s=2.0,
                                               topology="ring"))

    first = runtime("peer-000", [])
    first.start()
    second = runtime("peer-001", [first.address])
    second.start()
    endpoint = MetricsEndpoint("127.0.0.1:0").start(
        PeerCollector(first, metrics=lambda: {"accuracy": 0.5, "loss": 1.0}))
    try:
        wait_until(lambda: scrape(endpoint.url).value("murmura_peer_neighbours") == 1,
                   what="the second peer in the first one's view")
        before = peer_snapshot(first)
        threads = [threading.Thread(target=rt.run) for rt in (first, second)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        m = scrape(endpoint.url)
    finally:
        endpoint.stop()
        for rt in (first, second):
            rt.stop()

    assert m.value("murmura_peer_rounds_total") == 2 == m.value("murmura_peer_round")
    assert m.value("murmura_peer_models_mixed_total") >= 1
    assert m.value("murmura_bytes_sent_total") > 0
    assert m.value("murmura_test_accuracy") == 0.5
    missing = sorted(n for n in documented("peer") if not m.has(n))
    assert not missing, f"documented but not served: {missing}"
    assert not {"peer-000", "peer-001"} & m.label_values()
    assert set(before) == TOP_KEYS and before["role"] == "peer" and before["version"] == 0
    assert [p["peer_id"] for p in before["peers"]] == ["peer-001"]
    after = peer_snapshot(first)
    assert (after["version"], after["versions_total"], after["done"]) == (2, 2, True)


def test_the_grafana_dashboard_queries_only_documented_metrics() -> None:
    dashboard = json.loads((DOCS.parent / "grafana" / "murmura.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|count|sum)$", "", n)
            for e in exprs for n in re.findall(r"murmura_\w+", e)}

    assert len(exprs) > 15
    served = documented("server") | documented("dp")
    assert used and used <= served, used - served
    assert {"murmura_model_version", "murmura_test_accuracy", "murmura_rpc_duration_seconds",
            "murmura_requests_refused_total"} <= used
