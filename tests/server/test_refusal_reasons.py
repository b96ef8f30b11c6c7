"""Refusals are counted by status (``refused``, as before) and by status and a short reason
(``refused_by_reason``) in the metrics rows, summary.json and the durable counters."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from murmura.protocols import DeviceProfile, ModelSpec, TensorSpec, UpdateHeader
from murmura.protocols.errors import short_reason
from murmura.server import (
    AggregatorCore,
    FailedPrecondition,
    InvalidArgument,
    RunRecorder,
    ServerConfig,
)
from murmura.server.intake import MAX_REFUSAL_REASONS

SPEC = ModelSpec((TensorSpec("w", (4,)),))


def make_core(out: Path | None = None) -> AggregatorCore:
    config = ServerConfig.from_flat(mode="async", buffer_size=1, max_staleness=0,
                                    min_clients=1, max_versions=10, require_identity=False)
    return AggregatorCore(config, SPEC, np.zeros(4, np.float32),
                          recorder=RunRecorder(out) if out is not None else None)


def push(core: AggregatorCore, session: str, values: list[float], *, base: int) -> None:
    payload = np.asarray(values, "<f4").tobytes()
    header = UpdateHeader(session=session, update_id=f"u{np.random.randint(1 << 30)}",
                          base_version=base, round=0, num_examples=1, codec="dense-f32",
                          payload_bytes=len(payload), spec_fingerprint=core.fingerprint)
    core.push(header, payload, wire_bytes=len(payload))


def test_summary_json_groups_refusals_by_status_and_reason(tmp_path: Path) -> None:
    core = make_core(tmp_path)
    session = core.join("a", DeviceProfile()).session
    push(core, session, [1, 1, 1, 1], base=0)  # version 1
    for _ in range(3):  # trained on version 0: one version too old
        with pytest.raises(FailedPrecondition, match="versions old"):
            push(core, session, [1, 1, 1, 1], base=0)
    for size in (3, 5):  # two sizes, one reason: the numbers are not part of it
        with pytest.raises(InvalidArgument, match="payload is"):
            push(core, session, [1.0] * size, base=1)
    push(core, session, [1, 1, 1, 1], base=1)  # version 2: its row has the counts
    assert core.recorder is not None
    core.recorder.finish(plot=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["refused"] == {"FAILED_PRECONDITION": 3, "INVALID_ARGUMENT": 2}  # as before
    assert summary["refused_by_reason"] == {"FAILED_PRECONDITION: too stale": 3,
                                            "INVALID_ARGUMENT: payload does not decode": 2}
    assert core.counters()["refused_by_reason"] == summary["refused_by_reason"]  # kept durably


def test_a_reason_survives_a_worker_process_and_reasons_stay_bounded() -> None:
    error = pickle.loads(pickle.dumps(FailedPrecondition("update is 3 versions old",
                                                         reason="too stale")))
    assert error.key == "FAILED_PRECONDITION: too stale"
    assert short_reason("client 'n-x1' is not known (at 12:00); join first") == \
        "client … is not known"
    core = make_core()
    for i in range(MAX_REFUSAL_REASONS + 5):
        core.count_refusal(InvalidArgument("x", reason=f"reason {i}"))
    assert len(core.traffic.refused_by_reason) == MAX_REFUSAL_REASONS + 1
    assert core.traffic.refused_by_reason["INVALID_ARGUMENT: other"] == 5
    assert core.traffic.refused == {"INVALID_ARGUMENT": MAX_REFUSAL_REASONS + 5}
