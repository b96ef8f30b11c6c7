"""Reused receive buffers (server/buffers.py): the pool itself, and pushes over real gRPC on
loopback where a held update's bytes must survive the pushes that follow it."""

from __future__ import annotations

import mmap
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from murmura.aggregation import BufferedAggregator
from murmura.aggregation import base as aggregation_base
from murmura.client import GrpcTransport
from murmura.protocols import DeviceProfile, ModelSpec, TensorSpec, UpdateHeader
from murmura.server import AggregatorCore, ServerConfig, ServerThread
from murmura.server.buffers import ALIGNED_FROM, MIN_POOLED_BYTES, BufferPool

BIG = MIN_POOLED_BYTES + 4096  # pooled size


# -- the pool --------------------------------------------------------------------------------


def test_a_released_buffer_is_reused_with_its_pages() -> None:
    pool = BufferPool()
    lease = pool.acquire(BIG)
    lease.write(0, b"\x01" * BIG)
    assert bytes(lease.view[:3]) == b"\x01\x01\x01" and len(lease.view) == BIG
    assert pool.release(lease) and pool.free == 1
    again = pool.acquire(BIG - 10)  # fits: at least the size, at most twice
    assert pool.reused == 1 and pool.allocated == 1 and pool.free == 0
    assert len(again.view) == BIG - 10 and again.view[0] == 1  # the same memory


def test_a_buffer_still_referenced_is_never_reused() -> None:
    pool = BufferPool()
    lease = pool.acquire(BIG)
    lease.write(0, np.full(BIG // 4, 7.0, "<f4").tobytes())
    held = np.frombuffer(lease.view, dtype="<f4")  # what dense-f32 decoding returns
    assert not pool.release(lease)
    assert pool.free == 0 and pool.withheld == 1
    other = pool.acquire(BIG)
    other.write(0, b"\x00" * BIG)
    assert np.all(held == 7.0)
    del held
    assert pool.release(other) and pool.free == 1


def test_a_withheld_buffer_is_reused_once_its_last_view_is_gone() -> None:
    # Prepare: released while a decoded view still holds it (a synchronous push's fold)
    pool = BufferPool()
    lease = pool.acquire(BIG)
    lease.write(0, np.full(BIG // 4, 3.0, "<f4").tobytes())
    held = np.frombuffer(lease.view, dtype="<f4")
    assert not pool.release(lease) and pool.withheld == 1
    # Execute: the view goes, then the next push of that size asks for a buffer
    del held
    again = pool.acquire(BIG)
    # Assert: the parked buffer came back, with its pages (the bytes written before)
    assert pool.unparked == 1 and pool.reused == 1 and pool.allocated == 1
    assert np.frombuffer(again.view, dtype="<f4")[0] == 3.0


def test_parked_buffers_are_bounded_and_forgotten_by_clear() -> None:
    pool = BufferPool(max_free=2)
    views = []
    for _ in range(5):
        lease = pool.acquire(BIG)
        views.append(np.frombuffer(lease.view, dtype=np.uint8))
        assert not pool.release(lease)
    assert pool.withheld == 5 and len(pool._parked) == 2  # the two youngest
    views.clear()
    pool.clear()
    pool.acquire(BIG)
    assert pool.unparked == 0 and pool.allocated == 6


@pytest.mark.parametrize("keep", [
    lambda v: v,                                      # the view itself
    lambda v: v[10:20],                               # a slice of it
    lambda v: np.frombuffer(v, np.uint8)[5:],         # a numpy view of a slice
    lambda v: memoryview(np.frombuffer(v, np.uint8)),  # a memoryview of that
])
def test_any_surviving_view_keeps_the_buffer_out(keep: Callable[[memoryview], Any]) -> None:
    pool = BufferPool()
    lease = pool.acquire(BIG)
    kept = keep(lease.view)
    assert not pool.release(lease)
    assert kept is not None


def test_small_payloads_are_not_pooled_and_idle_buffers_are_bounded() -> None:
    pool = BufferPool(max_free=2)
    small = pool.acquire(100)
    assert not pool.release(small) and pool.free == 0
    leases = [pool.acquire(BIG) for _ in range(3)]
    assert [pool.release(x) for x in leases] == [True, True, True]
    assert pool.free == 2 and pool.free_bytes == 2 * BIG
    assert not pool.release(leases[0])  # twice: harmless
    huge = pool.acquire(3 * BIG)  # idle buffers too small: a new one
    assert pool.allocated == 4 and pool.free == 2
    pool.release(huge)
    tiny = pool.acquire(MIN_POOLED_BYTES)  # 3 x BIG idle is more than twice too big
    assert tiny.nbytes == MIN_POOLED_BYTES and pool.reused == 1  # one of the BIG ones
    pool.clear()
    assert pool.free == 0
    assert not BufferPool(max_free=0).release(BufferPool(max_free=0).acquire(BIG))


def test_writes_are_bounds_checked_and_released_leases_refuse_use() -> None:
    pool = BufferPool()
    lease = pool.acquire(BIG)
    with pytest.raises(ValueError, match="do not fit"):
        lease.write(BIG - 2, b"abc")
    pool.release(lease)
    with pytest.raises(ValueError, match="released"):
        lease.view  # noqa: B018
    with pytest.raises(ValueError, match="released"):
        lease.write(0, b"a")


@pytest.mark.parametrize("nbytes", [ALIGNED_FROM, 1_000_003, BIG])
def test_large_buffers_start_on_a_page_so_the_spool_can_write_them_directly(nbytes: int) -> None:
    pool = BufferPool()
    lease = pool.acquire(nbytes)
    data = np.frombuffer(lease.view, np.uint8)
    assert data.ctypes.data % mmap.PAGESIZE == 0 and data.size == nbytes
    lease.write(0, bytes(range(256)) * (nbytes // 256))
    assert bytes(lease.view[:256]) == bytes(range(256))
    del data
    assert pool.release(lease) is (nbytes >= MIN_POOLED_BYTES)  # small ones are never pooled


# -- over gRPC -------------------------------------------------------------------------------

P = BIG // 4  # floats per update: every push goes through a pooled buffer


@pytest.fixture
def serve() -> Iterator[Callable[..., tuple[ServerThread, GrpcTransport]]]:
    started: list[tuple[ServerThread, GrpcTransport]] = []

    def start(**cfg: Any) -> tuple[ServerThread, GrpcTransport]:
        cfg.setdefault("workers", 0)  # the in-process path: payloads land in these buffers
        cfg.setdefault("require_identity", False)  # raw legacy joins
        spec = ModelSpec((TensorSpec("w", (P,)),))
        core = AggregatorCore(ServerConfig.from_flat(**cfg), spec, np.zeros(P, np.float32))
        srv = ServerThread(core, "127.0.0.1:0").start()
        transport = GrpcTransport(srv.address, timeout_s=30)
        started.append((srv, transport))
        return srv, transport

    yield start
    for srv, transport in started:
        transport.close()
        srv.stop(grace=None)


def _push(t: GrpcTransport, session: str, update: np.ndarray, *, n: int, round_: int,
          base: int = 0) -> None:
    payload = update.astype("<f4").tobytes()
    header = UpdateHeader(session=session, update_id=uuid.uuid4().hex, base_version=base,
                          round=round_, num_examples=n, codec="dense-f32",
                          payload_bytes=len(payload),
                          spec_fingerprint=ModelSpec((TensorSpec("w", (P,)),)).fingerprint())
    result = t.push(header, payload)
    assert not result.duplicate


def _pool_stats(srv: ServerThread) -> dict[str, int]:
    def read() -> dict[str, int]:
        assert srv.server is not None and srv.server.servicer is not None
        pool = srv.server.servicer.buffers
        return {"allocated": pool.allocated, "reused": pool.reused, "withheld": pool.withheld,
                "free": pool.free}
    return srv.call(read)


def _model(srv: ServerThread) -> tuple[int, np.ndarray]:
    return srv.call(lambda: (srv.core.version, srv.core.params.copy()))


def test_held_out_of_order_updates_are_not_overwritten_by_later_pushes(serve) -> None:
    # Sync rounds fold in client-id order: c and b arrive first and wait, as views of their
    # receive buffers, for a; a's push (and the next round's) must not land in those buffers.
    srv, t = serve(min_clients=3)
    sessions = {c: t.join(c, DeviceProfile())[0].session for c in ("a", "b", "c")}
    for s in sessions.values():
        assert t.task(s, 0).action.name == "TRAIN"
    rng = np.random.default_rng(5)
    updates = {c: rng.standard_normal(P, dtype=np.float32) for c in ("a", "b", "c")}
    counts = {"a": 1, "b": 2, "c": 3}

    _push(t, sessions["c"], updates["c"], n=counts["c"], round_=1)
    _push(t, sessions["b"], updates["b"], n=counts["b"], round_=1)
    assert srv.call(lambda: srv.core.policy.buffered()) == 2
    stats = _pool_stats(srv)
    assert stats["allocated"] == 2 and stats["free"] == 0  # both still held by the policy
    _push(t, sessions["a"], updates["a"], n=counts["a"], round_=1)

    version, params = _model(srv)
    acc = np.zeros(P, np.float32)  # the fold the server does: a, b, c in order, float32
    for c in ("a", "b", "c"):
        acc += np.float32(counts[c]) * updates[c]
    expected = acc / np.float32(sum(counts.values()))
    assert version == 1
    np.testing.assert_allclose(params, expected, rtol=1e-5, atol=1e-6)
    # each buffer went back once its update was folded; the pool keeps two idle ones
    assert _pool_stats(srv)["free"] == 2

    # Round 2, again out of order, now reusing a pooled buffer for the held update.
    for s in sessions.values():
        assert t.task(s, 1).action.name == "TRAIN"
    new = {c: rng.standard_normal(P, dtype=np.float32) for c in ("a", "b", "c")}
    _push(t, sessions["b"], new["b"], n=1, round_=2, base=1)
    assert _pool_stats(srv)["reused"] == 1
    _push(t, sessions["c"], new["c"], n=1, round_=2, base=1)
    _push(t, sessions["a"], new["a"], n=1, round_=2, base=1)
    version, params2 = _model(srv)
    assert version == 2
    acc = np.zeros(P, np.float32)
    for c in ("a", "b", "c"):
        acc += new[c]
    np.testing.assert_allclose(params2, params + acc / np.float32(3), rtol=1e-5, atol=1e-5)


def test_async_pushes_reuse_one_buffer_and_fold_the_right_bytes(serve) -> None:
    srv, t = serve(mode="async", buffer_size=4, max_staleness=10)
    session = t.join("a", DeviceProfile())[0].session
    rng = np.random.default_rng(6)
    updates = [rng.standard_normal(P, dtype=np.float32) for _ in range(4)]
    for u in updates:
        assert t.task(session, 0).action.name == "TRAIN"
        _push(t, session, u, n=2, round_=0)
    stats = _pool_stats(srv)
    assert stats["allocated"] == 1 and stats["reused"] == 3 and stats["withheld"] == 0
    version, params = _model(srv)
    assert version == 1
    np.testing.assert_allclose(params, np.mean(updates, axis=0), rtol=1e-5, atol=1e-6)


def test_a_refused_push_leaves_the_pool_usable(serve) -> None:
    srv, t = serve(mode="async", buffer_size=2, max_staleness=10)
    session = t.join("a", DeviceProfile())[0].session
    bad = np.ones(P, np.float32)
    bad[7] = np.nan
    with pytest.raises(Exception, match="NaN"):
        _push(t, session, bad, n=1, round_=0)
    good = [np.full(P, v, np.float32) for v in (1.0, 3.0)]
    for u in good:
        _push(t, session, u, n=1, round_=0)
    version, params = _model(srv)
    assert version == 1 and np.all(params == 2.0)
    assert _pool_stats(srv)["withheld"] <= 1  # a refusal's traceback may keep its buffer


# -- decoder outputs (in-process path) -----------------------------------------------------------


def test_floats_is_a_bounded_float32_view_of_the_buffer() -> None:
    pool = BufferPool()
    lease = pool.acquire(BIG)
    values = lease.floats(BIG // 4)
    values[:] = 2.5
    assert values.dtype == np.float32 and np.frombuffer(lease.view, "<f4")[0] == 2.5
    with pytest.raises(ValueError, match="do not fit"):
        lease.floats(BIG // 4 + 1)
    assert not pool.release(lease)  # ``values`` still points into it
    del values


def _push_int8(t: GrpcTransport, session: str, update: np.ndarray, *, n: int, round_: int,
               base: int = 0) -> np.ndarray:
    """Push ``update`` as int8; returns what the server must decode it to."""
    from murmura.protocols import create_codec

    codec = create_codec("int8")
    payload = codec.encoder(P, seed=0).encode(update)
    header = UpdateHeader(session=session, update_id=uuid.uuid4().hex, base_version=base,
                          round=round_, num_examples=n, codec="int8", payload_bytes=len(payload),
                          spec_fingerprint=ModelSpec((TensorSpec("w", (P,)),)).fingerprint())
    assert not t.push(header, payload).duplicate
    return codec.decode(payload, P)


def _push_int8_series(t: GrpcTransport, count: int, *, seed: int, n: int) -> list[np.ndarray]:
    """One client joins and pushes ``count`` int8 updates of version 0, each after a TRAIN
    task; returns what the server must decode them to."""
    session = t.join("a", DeviceProfile())[0].session
    rng = np.random.default_rng(seed)
    decoded = []
    for _ in range(count):
        assert t.task(session, 0).action.name == "TRAIN"
        decoded.append(_push_int8(t, session, rng.standard_normal(P, dtype=np.float32), n=n,
                                  round_=0))
    return decoded


def _output_stats(srv: ServerThread) -> dict[str, int]:
    def read() -> dict[str, int]:
        assert srv.server is not None
        pool = srv.server.servicer.tier.outputs
        return {"allocated": pool.allocated, "reused": pool.reused, "free": pool.free}
    return srv.call(read)


def test_held_int8_updates_keep_their_decoded_values_while_later_ones_decode(serve) -> None:
    # As with payloads: c and b wait for a in their decoder outputs, which must not be reused
    # for a's decode, and come back to the pool once folded.
    srv, t = serve(min_clients=3)
    sessions = {c: t.join(c, DeviceProfile())[0].session for c in ("a", "b", "c")}
    rng = np.random.default_rng(7)
    for rnd, base in ((1, 0), (2, 1)):
        for s in sessions.values():
            assert t.task(s, base).action.name == "TRAIN"
        decoded = {c: _push_int8(t, sessions[c], rng.standard_normal(P, dtype=np.float32),
                                 n=1, round_=rnd, base=base) for c in ("c", "b")}
        if rnd == 1:
            assert _output_stats(srv) == {"allocated": 2, "reused": 0, "free": 0}
        _, before = _model(srv)
        decoded["a"] = _push_int8(t, sessions["a"], rng.standard_normal(P, dtype=np.float32),
                                  n=1, round_=rnd, base=base)
        version, params = _model(srv)
        acc = np.zeros(P, np.float32)
        for c in ("a", "b", "c"):
            acc += decoded[c]
        assert version == rnd
        np.testing.assert_allclose(params, before + acc / np.float32(3), rtol=1e-5, atol=1e-6)
    stats = _output_stats(srv)
    assert stats["reused"] >= 2 and stats["allocated"] <= 4 and stats["free"] == 2


def test_async_int8_pushes_decode_into_one_reused_output(serve) -> None:
    srv, t = serve(mode="async", buffer_size=4, max_staleness=10)
    decoded = _push_int8_series(t, 4, seed=8, n=2)
    assert _output_stats(srv) == {"allocated": 1, "reused": 3, "free": 1}
    version, params = _model(srv)
    assert version == 1
    np.testing.assert_allclose(params, np.mean(decoded, axis=0), rtol=1e-5, atol=1e-6)


class _KeepsUpdates(BufferedAggregator):
    """An app-defined rule that keeps the arrays it is given, without copying them: legal (a
    rule owns what it was handed), and exactly what a reused decoder output must survive."""

    name = "test-keeps-updates"

    def add(self, update, weight, *, factor=1.0, client_id=""):  # noqa: ANN001, ANN201
        self._check(update, weight, factor)
        self._updates.append(update)
        self._weights.append(float(weight))
        self._factors.append(float(factor))
        self._ids.append(client_id)

    def combine(self, updates, weights, factors, client_ids):  # noqa: ANN001, ANN201
        return updates.mean(axis=0).astype(np.float32)


def test_a_rule_that_keeps_its_updates_keeps_their_outputs_out_of_the_pool(
        serve, monkeypatch: pytest.MonkeyPatch) -> None:
    # registered for this test only (the registry is global; CLI help lists every rule)
    monkeypatch.setitem(aggregation_base._REGISTRY, _KeepsUpdates.name,
                        lambda size, **_: _KeepsUpdates(size))
    # Each update is folded (kept by reference) before the next push decodes: an output
    # returned to the pool after its fold would be overwritten by the next decode.
    srv, t = serve(mode="async", buffer_size=3, max_staleness=10, defense=_KeepsUpdates.name)
    decoded = _push_int8_series(t, 3, seed=9, n=1)
    version, params = _model(srv)
    assert version == 1
    np.testing.assert_allclose(params, np.mean(decoded, axis=0), rtol=1e-5, atol=1e-6)
    assert _output_stats(srv)["reused"] == 0  # every output was still held by the rule
