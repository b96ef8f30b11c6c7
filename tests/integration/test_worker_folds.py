"""Folds in the aggregation workers (server/folds.py) over real gRPC on loopback: partial
aggregates in shared memory give the flat run's model, bit for bit in exact mode whatever the
number of workers, and a worker killed mid-fold loses nothing and counts nothing twice."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from murmura.client import GrpcTransport
from murmura.protocols import (
    DeviceProfile,
    ModelSpec,
    TaskSettings,
    TensorSpec,
    UpdateHeader,
    create_codec,
)
from murmura.server import AggregatorCore, ServerConfig
from murmura.server.app import assemble_core
from tests.conftest import wait_until

pytestmark = pytest.mark.integration

SIZE = 30_000


def spec(size: int = SIZE) -> ModelSpec:
    return ModelSpec((TensorSpec("w", (size,)),))


def update_for(client: int, version: int, size: int = SIZE) -> np.ndarray:
    """A deterministic update per (client, version), with values over many magnitudes."""
    rng = np.random.default_rng([client, version, 7])
    return (rng.standard_normal(size) * 10.0 ** rng.integers(-5, 1, size)).astype(np.float32)


def run(serve, *, workers: int, folds: str = "on", codec: str = "dense-f32",
        clients: int = 5, versions: int = 2, mode: str = "sync", accumulator: str = "float32",
        options: dict[str, str] | None = None, before_push=None, out_dir: Path | None = None,
        size: int = SIZE, defense: str = "fedavg", make_update=update_for,
        in_order: bool = False, receivers: int = 0) -> tuple[np.ndarray, dict]:
    """``versions`` versions of ``clients`` concurrent pushes (``in_order``: one after the
    other, in client order, for an async buffer whose order matters); the final model and
    the last metrics row's tier figures (``receivers``: pushed through that many receiver
    processes). Also used by test_rule_columns.py and test_receivers.py."""
    extra = {"buffer_size": clients} if mode == "async" else {}
    cfg = ServerConfig.from_flat(min_clients=clients, max_versions=versions, workers=workers,
                                 max_workers=max(workers, 1), worker_folds=folds, mode=mode,
                                 require_identity=False, accumulator=accumulator,
                                 defense=defense, receivers=receivers,
                                 train=TaskSettings(codec=codec, codec_options=options or {}),
                                 **extra)
    if out_dir is None:
        core = AggregatorCore(cfg, spec(size), np.zeros(size, np.float32))
    else:  # durable state in out_dir (SQLite and a spool file): acknowledged = on disk
        core = assemble_core(cfg, spec(size), np.zeros(size, np.float32), out_dir=out_dir,
                             durable=True)
    srv = serve(core)
    if before_push is not None:
        before_push(srv)
    t = GrpcTransport(srv.address, timeout_s=60)
    sessions = [t.join(f"client-{i}", DeviceProfile())[0].session for i in range(clients)]
    assert bool(t.push_address) == bool(receivers)
    codec_obj = create_codec(codec, options or {})
    for _ in range(versions):
        tasks = [t.task(s, 5.0) for s in sessions]
        version = tasks[0].version

        def push(i: int, version: int, round_: int) -> None:
            payload = codec_obj.encoder(size, seed=i).encode(make_update(i, version, size))
            t.push(UpdateHeader(session=sessions[i], update_id=uuid.uuid4().hex[:12],
                                base_version=version, round=round_, num_examples=10 + i,
                                codec=codec, payload_bytes=len(payload),
                                spec_fingerprint=spec(size).fingerprint()), payload)
        if in_order:
            for i in range(clients):
                push(i, version, tasks[i].round)
        else:
            threads = [threading.Thread(target=push, args=(i, version, tasks[i].round))
                       for i in reversed(range(clients))]  # arrivals out of cohort order
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        wait_until(lambda v=version: t.pull(sessions[0])[0] == v + 1, what="the next version")
    params = t.pull(sessions[0])[1]
    figures = srv.call(lambda: {**srv.core.last_metrics, **(
        srv.core.folds.stats() if srv.core.folds is not None else {}), "folded": (
        srv.core.folds.folded if srv.core.folds is not None else 0)})
    t.close()
    return params, figures


def test_exact_partials_folded_by_1_2_and_4_workers_are_the_flat_model_bit_for_bit(
        serve) -> None:
    flat, figures = run(serve, workers=0, accumulator="exact")
    assert figures["folded"] == 0  # in-process: the publisher folds
    for workers in (1, 2, 4):
        model, figures = run(serve, workers=workers, accumulator="exact")
        assert figures["folded"] == 10, "the updates were not folded in the workers"
        assert np.array_equal(model, flat), f"{workers} workers differ from the flat run"
    assert np.abs(flat).sum() > 0


def test_float32_worker_folds_match_the_publisher_and_a_rerun_bit_for_bit(serve) -> None:
    """int8 decoded in workers and folded there into 2 slots, merged by a fixed tree: the
    same model as the publisher's one-at-a-time fold up to float32 rounding, and the same
    bits on a rerun (folds go to slots in the policy's order, not by arrival)."""
    publisher, figures = run(serve, workers=2, folds="off", codec="int8")
    assert figures["folded"] == 0
    in_workers, figures = run(serve, workers=2, codec="int8")
    assert figures["folded"] == 10 and figures["worker_folds"] >= 5  # row made at publish
    np.testing.assert_allclose(in_workers, publisher, rtol=1e-5, atol=1e-7)
    again, _ = run(serve, workers=2, codec="int8")
    assert np.array_equal(again, in_workers)


def test_async_buffers_fold_in_the_workers(serve) -> None:
    flat, _ = run(serve, workers=0, mode="async", accumulator="exact", versions=2)
    model, figures = run(serve, workers=2, mode="async", accumulator="exact", versions=2)
    assert figures["folded"] == 10
    assert np.array_equal(model, flat)


def test_a_worker_killed_mid_fold_loses_nothing_and_counts_nothing_twice(
        serve, tmp_path: Path) -> None:
    marker = tmp_path / "die-in-the-next-fold"
    marker.touch()

    def arm(srv) -> None:
        srv.call(lambda: setattr(srv.core.folds, "die_if", str(marker)))

    flat, _ = run(serve, workers=0, accumulator="exact", versions=1)
    model, figures = run(serve, workers=2, accumulator="exact", versions=1, before_push=arm)
    assert not marker.exists(), "no fold ran into the crash point"
    assert figures["folded"] == 5 and figures["fold_fallbacks"] == 0
    assert np.array_equal(model, flat)


def test_small_models_fold_on_the_publisher_unless_asked(serve) -> None:
    """``auto`` leaves a model under MIN_VALUES to the publisher (a job costs more than
    the fold); the figure in the metrics row says which path ran."""
    _, figures = run(serve, workers=2, folds="auto", versions=1)
    assert figures["folded"] == 0 and "worker_folds" not in figures


def test_int8_folded_from_its_payload_by_one_worker_is_the_publishers_model_bit_for_bit(
        serve) -> None:
    """One slot folds in the policy's order, as the publisher does, and the fused
    dequantise-and-add computes the decoder's values and adds them as a dense fold does."""
    publisher, _ = run(serve, workers=1, folds="off", codec="int8")
    fused, figures = run(serve, workers=1, codec="int8")
    assert figures["folded"] == 10
    assert np.array_equal(fused, publisher)


def test_topk_is_scattered_into_the_partials_in_place(serve) -> None:
    opts = {"ratio": "0.05"}
    publisher, _ = run(serve, workers=2, folds="off", codec="topk", options=opts)
    fused, figures = run(serve, workers=2, codec="topk", options=opts)
    assert figures["folded"] == 10
    np.testing.assert_allclose(fused, publisher, rtol=1e-5, atol=1e-8)
    assert np.count_nonzero(fused) > 0


def test_a_worker_killed_mid_scatter_adds_the_update_once(serve, tmp_path: Path) -> None:
    """Top-k folds in place: the retry undoes the dead worker's half-done scatter-add."""
    opts = {"ratio": "0.05"}
    marker = tmp_path / "die"

    # one worker, one slot: the first fold of a version fills it, the second (the one that
    # dies) adds in place
    def arm(srv) -> None:
        marker.touch()
        srv.call(lambda: setattr(srv.core.folds, "die_if", str(marker)))

    clean, _ = run(serve, workers=1, codec="topk", options=opts)
    model, figures = run(serve, workers=1, codec="topk", options=opts, before_push=arm)
    assert not marker.exists(), "no fold ran into the crash point"
    assert figures["fold_fallbacks"] == 0
    assert np.array_equal(model, clean)


def test_a_damaged_partial_is_rebuilt_from_the_spooled_updates(serve, tmp_path: Path) -> None:
    """A worker that leaves a NaN in its slot (a broken worker, simulated): the publisher
    finds the merged partial out of range and folds the version's updates again from the
    durable spool; no version is lost and the model is the clean run's."""
    marker = tmp_path / "poison"

    def arm(srv) -> None:
        marker.touch()
        srv.call(lambda: setattr(srv.core.folds, "poison_if", str(marker)))

    clean, _ = run(serve, workers=2, codec="int8", out_dir=tmp_path / "clean")
    model, figures = run(serve, workers=2, codec="int8", out_dir=tmp_path / "poisoned",
                         before_push=arm)
    assert not marker.exists() and figures["versions_rebuilt"] == 1
    assert np.isfinite(model).all()
    np.testing.assert_allclose(model, clean, rtol=1e-5, atol=1e-7)


def test_without_durable_state_a_damaged_partial_drops_its_version(serve,
                                                                   tmp_path: Path) -> None:
    marker = tmp_path / "poison"

    def arm(srv) -> None:
        marker.touch()
        srv.call(lambda: setattr(srv.core.folds, "poison_if", str(marker)))

    cfg = ServerConfig.from_flat(min_clients=2, max_versions=3, workers=2, max_workers=2,
                                 worker_folds="on", require_identity=False,
                                 train=TaskSettings(codec="dense-f32"))
    srv = serve(AggregatorCore(cfg, spec(), np.zeros(SIZE, np.float32)))
    arm(srv)
    t = GrpcTransport(srv.address, timeout_s=60)
    sessions = [t.join(f"c{i}", DeviceProfile())[0].session for i in range(2)]
    for i, s in enumerate(sessions):
        task = t.task(s, 5.0)
        payload = np.full(SIZE, 1.0 + i, "<f4").tobytes()
        t.push(UpdateHeader(session=s, update_id=uuid.uuid4().hex[:12], base_version=0,
                            round=task.round, num_examples=1, codec="dense-f32",
                            payload_bytes=len(payload), spec_fingerprint=spec().fingerprint()),
               payload)
    wait_until(lambda: srv.call(lambda: srv.core.policy.round) >= 1 and
               srv.call(lambda: srv.core.publisher.pending) == 0, what="the round to close")
    version, params = t.pull(sessions[0])
    assert version == 0 and not np.any(params)  # dropped: the model is untouched
    assert np.isfinite(params).all()
    t.close()


def test_without_free_slots_updates_fold_on_the_publisher(serve) -> None:
    """When no slot can be had (the slots of MAX_EPOCHS versions in use), an update is folded
    on the publisher instead of being refused or lost."""
    def starve(srv) -> None:
        def no_slots() -> None:
            folds = srv.core.folds
            while folds._pool.acquire(folds.slot_bytes) is not None:
                pass  # every slot the cap allows is taken
        srv.call(no_slots)

    flat, _ = run(serve, workers=0, accumulator="exact")
    model, figures = run(serve, workers=2, accumulator="exact", before_push=starve)
    assert figures["folded"] == 0
    assert np.array_equal(model, flat)
