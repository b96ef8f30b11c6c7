"""A malformed evaluation report riding on an update (NaN, infinity, no version) is logged and
ignored while the update is taken, as docs/apps.md promises; over real gRPC on loopback."""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from murmura.client import GrpcTransport, RemoteError
from murmura.protocols import DeviceProfile, ModelSpec, TensorSpec, UpdateHeader
from murmura.server import AggregatorCore, ServerConfig, ServerThread
from murmura.server.client_eval import report_from_metrics

SPEC = ModelSpec((TensorSpec("w", (4,)),))


@pytest.fixture
def serve() -> Iterator[Callable[..., tuple[ServerThread, GrpcTransport]]]:
    started: list[tuple[ServerThread, GrpcTransport]] = []

    def start(**cfg: Any) -> tuple[ServerThread, GrpcTransport]:
        cfg.setdefault("require_identity", False)  # raw legacy joins
        core = AggregatorCore(ServerConfig.from_flat(**cfg), SPEC, np.zeros(4, np.float32))
        srv = ServerThread(core, "127.0.0.1:0").start()
        transport = GrpcTransport(srv.address, timeout_s=30)
        started.append((srv, transport))
        return srv, transport

    yield start
    for srv, transport in started:
        transport.close()
        srv.stop(grace=None)


def _push(t: GrpcTransport, session: str, value: float, metrics: dict[str, float]) -> None:
    payload = np.full(4, value, "<f4").tobytes()
    result = t.push(UpdateHeader(session=session, update_id=uuid.uuid4().hex, base_version=0,
                                 round=1, num_examples=10, codec="dense-f32",
                                 payload_bytes=len(payload),
                                 spec_fingerprint=SPEC.fingerprint(), metrics=metrics), payload)
    assert not result.duplicate


@pytest.mark.integration
def test_a_nan_in_an_evaluation_report_drops_the_report_not_the_update(
        serve, caplog: pytest.LogCaptureFixture) -> None:
    srv, t = serve(mode="sync", min_clients=2, max_versions=1)
    a, b = (t.join(c, DeviceProfile())[0].session for c in ("a", "b"))
    t.task(a, 0.0)
    t.task(b, 0.0)
    good = {"eval_version": 0.0, "eval_examples": 20.0, "eval_accuracy": 0.75,
            "train_loss": 0.5}
    bad = {"eval_version": 0.0, "eval_examples": 20.0, "eval_accuracy": math.nan,
           "eval_loss": math.inf, "train_loss": 0.5}
    with caplog.at_level(logging.WARNING, logger="murmura.server"):
        _push(t, a, 1.0, good)
        _push(t, b, 3.0, bad)                     # taken: the version is made of both
    core = srv.core
    assert core.version == 1
    np.testing.assert_allclose(core.params, 2.0)
    row = core.last_metrics
    assert row["client_eval_clients"] == 1 and row["client_accuracy_mean"] == 0.75
    assert any("client b sent a malformed evaluation report" in r.getMessage()
               for r in caplog.records)


@pytest.mark.integration
def test_a_non_finite_training_metric_is_still_refused(serve) -> None:
    _, t = serve(mode="async", buffer_size=5)
    a = t.join("a", DeviceProfile())[0].session
    t.task(a, 0.0)
    with pytest.raises(RemoteError, match="metric 'train_loss' must be a finite number"):
        _push(t, a, 1.0, {"train_loss": math.nan})


@pytest.mark.parametrize("metrics", [
    {"eval_version": 0.0, "eval_examples": 5.0, "eval_accuracy": math.nan},
    {"eval_version": math.nan, "eval_examples": 5.0, "eval_accuracy": 0.5},
    {"eval_version": math.inf, "eval_examples": 5.0},
    {"eval_examples": 5.0, "eval_accuracy": 0.5},            # no version
    {"eval_version": 0.0, "eval_examples": "5", "eval_accuracy": 0.5},   # not a number
    {"eval_version": 0.0, "eval_examples": 5.0, "eval_accuracy": None},
])
def test_malformed_reports_are_none_and_never_raise(metrics: dict[str, Any]) -> None:
    assert report_from_metrics("c", metrics) is None
