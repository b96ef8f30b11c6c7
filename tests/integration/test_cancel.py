"""A client that cancels (or hits its deadline) while its Join or Push waits never hangs the
server: the call is cancelled at every await point of the handler, then the server must answer
the next calls and the update must land exactly once.

The cancellation is injected through the servicer's ``await_hook``, which cancels the handler's
own task just before it waits at the chosen point, so the cancellation arrives inside that
wait, as gRPC delivers it when the client goes away;
the state store's ``before_commit`` hook holds the group commit back so that the durable waits
are really pending when the cancellation arrives (the bug this guards against: a cancelled
wait cancelled the store's future and the store thread died on completing it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import numpy as np
import pytest

from murmura.client import GrpcTransport, RemoteError
from murmura.protocols import DeviceProfile, ModelSpec, TensorSpec, UpdateHeader
from murmura.server import ServerConfig
from murmura.server.app import assemble_core
from murmura.server.service import AWAIT_POINTS
from tests.conftest import wait_until

SPEC = ModelSpec((TensorSpec("w", (32,)),))
PAYLOAD = np.full(32, 0.25, "<f4").tobytes()
#: The deadline of the call that is cancelled on the server: a handler cancelled there sends
#: no status (as when its client went away), so this client learns of it at its deadline.
HASTY_S = 1.5


def header(session: str, uid: str, base: int = 0) -> UpdateHeader:
    return UpdateHeader(session=session, update_id=uid, base_version=base, num_examples=4,
                        codec="dense-f32", payload_bytes=len(PAYLOAD),
                        spec_fingerprint=SPEC.fingerprint())


class Canceller:
    """The servicer's await hook: cancels the handler's task at ``point`` (once), and records
    every point handlers passed."""

    def __init__(self, point: str) -> None:
        self.point = point
        self.seen: list[str] = []
        self.fired = threading.Event()

    def __call__(self, point: str) -> None:
        self.seen.append(point)
        if point == self.point and not self.fired.is_set():
            self.fired.set()
            task = asyncio.current_task()
            assert task is not None
            task.cancel()


@pytest.fixture
def durable_server(tmp_path, serve):
    core = assemble_core(ServerConfig.from_flat(mode="async", buffer_size=2, max_versions=50,
                                                workers=0, require_identity=False),
                         SPEC, np.zeros(32, np.float32), out_dir=tmp_path, durable=True)
    srv = serve(core)
    yield srv, core
    if core.store is not None:
        core.store.before_commit = None


@pytest.fixture
def clients(durable_server):
    """(t, hasty): a patient client, and one whose calls time out after HASTY_S."""
    srv, _ = durable_server
    t = GrpcTransport(srv.address, timeout_s=20)
    hasty = GrpcTransport(srv.address, timeout_s=HASTY_S)
    yield t, hasty
    t.close()
    hasty.close()


def _hold_commits(core):
    """Hold every group commit until the returned event is set."""
    gate = threading.Event()
    core.store.before_commit = lambda: gate.wait(30)
    return gate


@pytest.mark.integration
@pytest.mark.parametrize("point", [p for p in AWAIT_POINTS if p.startswith("push.")])
def test_push_cancelled_at_each_await_point_lands_once(durable_server, clients, point) -> None:
    srv, core = durable_server
    t, hasty = clients
    session = t.join("a", DeviceProfile())[0].session
    gate = first = None
    if point == "push.duplicate":
        gate = _hold_commits(core)
        # u1's first push waits for its held commit while its retry is cancelled.
        first = concurrent.futures.ThreadPoolExecutor(1).submit(
            t.push, header(session, "u1"), PAYLOAD)
        wait_until(lambda: srv.call(lambda: core.traffic.updates) == 1, what="u1 taken")
    else:
        # u1 fills half the buffer, so u2 completes a version (the publish await points).
        assert not t.push(header(session, "u1"), PAYLOAD).duplicate
        if point == "push.durable":
            gate = _hold_commits(core)
    target = "u1" if point == "push.duplicate" else "u2"
    hook = Canceller(point)
    srv.server.servicer.await_hook = hook
    with pytest.raises(RemoteError):
        hasty.push(header(session, target), PAYLOAD)
    assert hook.fired.is_set(), f"the push never reached {point}: {hook.seen}"
    srv.server.servicer.await_hook = None
    if gate is not None:
        gate.set()
    if first is not None:
        assert not first.result(20).duplicate
    # The server answers at once, and a retry of the cancelled update counts it once.
    reply = t.push(header(session, target), PAYLOAD)
    if point in ("push.receive", "push.decode", "push.spool"):
        assert not reply.duplicate  # cancelled before it was taken: taken now
    else:
        assert reply.duplicate      # taken before the cancel: answered as a duplicate
    for uid in sorted({"u2", "u3", "u4"} - {target}):  # 4 distinct updates: 2 versions
        base = srv.call(lambda: core.version)
        assert not t.push(header(session, uid, base), PAYLOAD).duplicate
    wait_until(lambda: srv.call(lambda: core.version) >= 2, what="version 2")
    assert srv.call(lambda: core.traffic.updates) == 4  # u1..u4, none twice
    assert srv.call(lambda: core.store_error) is None
    # the durable state holds every acknowledged update once: nothing pending twice
    assert srv.call(lambda: core.policy.buffered()) == 0
    t.join("b", DeviceProfile())  # Join is not stuck behind a dead store thread


@pytest.mark.integration
def test_join_cancelled_while_its_session_commits(durable_server, clients) -> None:
    srv, core = durable_server
    t, hasty = clients
    hook = Canceller("join.durable")
    srv.server.servicer.await_hook = hook
    gate = _hold_commits(core)
    with pytest.raises(RemoteError):
        hasty.join("a", DeviceProfile())
    assert hook.fired.is_set()
    srv.server.servicer.await_hook = None
    gate.set()
    session = t.join("a", DeviceProfile())[0].session  # joins again, at once
    assert not t.push(header(session, "u1"), PAYLOAD).duplicate
    assert srv.call(lambda: core.store_error) is None


@pytest.mark.integration
def test_client_deadline_during_commit_does_not_stall_the_server(durable_server) -> None:
    """The field report: a push whose client deadline passes while its commit is pending."""
    srv, core = durable_server
    t = GrpcTransport(srv.address, timeout_s=20)
    hasty = GrpcTransport(srv.address, timeout_s=0.3)
    try:
        session = t.join("a", DeviceProfile())[0].session
        gate = _hold_commits(core)
        with pytest.raises(RemoteError) as err:
            hasty.push(header(session, "u1"), PAYLOAD)
        assert err.value.status == "DEADLINE_EXCEEDED"
        gate.set()
        assert t.push(header(session, "u1"), PAYLOAD).duplicate  # committed once
        assert not t.push(header(session, "u2"), PAYLOAD).duplicate
        wait_until(lambda: srv.call(lambda: core.version) >= 1, what="version 1")
        assert srv.call(lambda: core.traffic.updates) == 2
    finally:
        t.close()
        hasty.close()


@pytest.mark.integration
def test_every_await_point_is_named_and_reached(durable_server) -> None:
    """A join, two pushes that make a version and a retried push pass every point in
    AWAIT_POINTS, so each parametrised case above cancels a wait that really happens."""
    srv, core = durable_server
    hook = Canceller("")  # never fires: records the points passed
    srv.server.servicer.await_hook = hook
    t = GrpcTransport(srv.address, timeout_s=20)
    try:
        session = t.join("a", DeviceProfile())[0].session
        t.push(header(session, "u1"), PAYLOAD)
        t.push(header(session, "u2"), PAYLOAD)
        assert t.push(header(session, "u2"), PAYLOAD).duplicate
    finally:
        t.close()
    assert set(hook.seen) == set(AWAIT_POINTS)
