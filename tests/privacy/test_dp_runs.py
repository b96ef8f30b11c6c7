"""DP through the real aggregator: the simulator, the core, the command line and gRPC.

Every run here is small (tens of clients, a handful of versions) but goes through the code a
deployment runs: the config, the policy, the publisher, the metrics rows and summary.json.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from murmura.cli import main
from murmura.protocols import DeviceProfile, ModelSpec, TaskSettings, TensorSpec, UpdateHeader
from murmura.server import AggregatorCore, ServerConfig, build_core
from murmura.server.checkpoint import load_checkpoint
from murmura.server.privacy import library_epsilon
from murmura.simulation import SimulationConfig, SimulationResult, simulate
from murmura.tasks import TaskConfig, load_task

pytestmark = pytest.mark.skipif(importlib.util.find_spec("dp_accounting") is None,
                                reason='needs dp-accounting: pip install "murmura[privacy]"')

TASK = TaskConfig(task="synthetic", model="logreg", partition="iid")
TRAIN = TaskSettings(local_epochs=1, batch_size=10, lr=0.2, momentum=0.0)
CLIENTS, COHORT = 40, 10


def run(tmp: Path | None, *, versions: int = 4, seed: int = 0, **dp: Any) -> SimulationResult:
    server = ServerConfig.from_flat(max_versions=versions, cohort_size=COHORT, seed=seed,
                                    round_deadline_s=1e9, train=TRAIN, **dp)
    sim = SimulationConfig(clients=CLIENTS, samples_per_client=20,
                           out=str(tmp) if tmp else "unused")
    return simulate(TASK, server, sim, out_dir=tmp if tmp else None)


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_simulated_dp_run_reports_the_librarys_epsilon_every_version(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    result = run(tmp_path, dp_clip=0.5, dp_noise_multiplier=1.2)
    got = rows(tmp_path)
    q = COHORT / CLIENTS
    assert [r["version"] for r in got] == [1, 2, 3, 4]
    for k, row in enumerate(got, start=1):
        assert row["dp_sampling_rate"] == q and row["dp_cohort"] == COHORT
        assert row["dp_clip"] == 0.5 and row["dp_noise_multiplier"] == 1.2
        assert row["dp_noise_std"] == pytest.approx(1.2 * 0.5 / COHORT)
        assert row["dp_epsilon"] == pytest.approx(library_epsilon([(q, 1.2, k)], 1e-5),
                                                  rel=1e-12)
        assert row["dp_epsilon_unsampled"] > row["dp_epsilon"]
    epsilons = [r["dp_epsilon"] for r in got]
    assert all(a < b for a, b in zip(epsilons, epsilons[1:], strict=False))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dp_epsilon"] == epsilons[-1] == summary["privacy"]["epsilon"]
    assert summary["privacy"]["delta"] == 1e-5 and summary["privacy"]["stopped"] is None
    assert "dp-accounting" in summary["privacy"]["accountant"]
    assert result.version == 4


def test_the_target_epsilon_stops_the_run_before_it_is_exceeded(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    q, z = COHORT / CLIENTS, 2.0
    eps3, eps4 = (library_epsilon([(q, z, k)], 1e-5) for k in (3, 4))
    target = (eps3 + eps4) / 2
    result = run(tmp_path, versions=8, dp_clip=0.5, dp_noise_multiplier=z,
                 dp_target_epsilon=target)
    assert result.version == 3 and result.summary["simulation"]["done"]
    assert [r["version"] for r in rows(tmp_path)] == [1, 2, 3]
    summary = json.loads((tmp_path / "summary.json").read_text())
    reason = summary["privacy"]["stopped"]
    assert "version 4 would bring epsilon to" in reason and "\n" not in reason
    assert summary["dp_epsilon"] == pytest.approx(eps3, rel=1e-12) and eps3 <= target


def test_adaptive_clipping_in_async_buffers(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    server = ServerConfig.from_flat(mode="async", buffer_size=8, max_versions=4, seed=1,
                                    train=TRAIN, dp_clip=0.05, dp_noise_multiplier=1.0,
                                    dp_clip_adaptive=0.5, dp_clip_lr=0.5)
    simulate(TASK, server, SimulationConfig(clients=CLIENTS, samples_per_client=20),
             out_dir=tmp_path)
    got = rows(tmp_path)
    assert len(got) == 4 and all(r["dp_cohort"] == 8 for r in got)
    assert got[0]["dp_clip"] == 0.05 and got[-1]["dp_clip"] != 0.05  # the clip adapts
    assert all("dp_below_clip" in r and r["dp_delta_noise_multiplier"] > 1.0 for r in got)
    assert got[-1]["dp_epsilon"] == pytest.approx(
        library_epsilon([(r["dp_sampling_rate"], 1.0, 1) for r in got], 1e-5), rel=1e-9)


def test_two_runs_with_one_seed_give_identical_models() -> None:
    torch.set_num_threads(1)
    dp: dict[str, Any] = {"dp_clip": 0.5, "dp_noise_multiplier": 1.0, "dp_clip_adaptive": 0.5}
    first, second = run(None, versions=3, **dp), run(None, versions=3, **dp)
    np.testing.assert_array_equal(first.params, second.params)
    other = run(None, versions=3, seed=1, **dp)
    assert not np.array_equal(first.params, other.params)


# -- the core: a restart continues the ledger ----------------------------------------------

SPEC = ModelSpec((TensorSpec("w", (4,)),))


def push(core: AggregatorCore, session: str, values: list[float]) -> None:
    payload = np.asarray(values, "<f4").tobytes()
    core.push(UpdateHeader(session=session, update_id=f"u{np.random.randint(1 << 30)}",
                           base_version=core.version, round=core.policy.round,  # type: ignore
                           num_examples=5, codec="dense-f32", payload_bytes=len(payload),
                           spec_fingerprint=core.fingerprint), payload)


def versions(core: AggregatorCore, n: int) -> None:
    sessions = [core.join(c, DeviceProfile()).session for c in ("a", "b")] \
        if not core.sessions else list(core.sessions)
    for _ in range(n):
        for s in sessions:
            core.task(s)
        for s in sessions:
            push(core, s, [3.0, 4.0, 0.0, 0.0])


def test_a_resumed_run_continues_its_privacy_ledger(tmp_path: Path) -> None:
    cfg = ServerConfig.from_flat(min_clients=2, require_identity=False, max_versions=5,
                                 dp_clip=1.0, dp_noise_multiplier=2.0)
    ckpt = tmp_path / "checkpoint.npz"
    first = AggregatorCore(cfg, SPEC, np.zeros(4, np.float32), checkpoint_path=ckpt)
    versions(first, 2)
    assert first.version == 2
    start = load_checkpoint(ckpt)
    second = AggregatorCore(cfg, SPEC, np.zeros(4, np.float32), checkpoint_path=ckpt,
                            start=start)
    versions(second, 1)
    assert second.version == 3
    assert second.last_metrics["dp_epsilon"] == pytest.approx(
        library_epsilon([(1.0, 2.0, 3)], 1e-5), rel=1e-12)


# -- refusals: one line naming what works ---------------------------------------------------


@pytest.mark.parametrize(("flags", "match"), [
    (["--defense", "median"], "needs --defense fedavg; defense 'median'"),
    (["--defense", "krum"], "needs --defense fedavg"),
    (["--mode", "compass", "--local-steps", "5"], "runs in mode sync or async"),
    (["--dp-clip", "0", "--dp-noise-multiplier", "1"], "needs dp_clip"),
    (["--dp-delta", "1"], "dp_delta must lie in"),
    (["--dp-noise-multiplier", "-1"], "dp_noise_multiplier must be"),
    (["--dp-target-epsilon", "3", "--dp-noise-multiplier", "0"], "needs dp_noise_multiplier"),
])
def test_refused_combinations_exit_2_with_one_line(flags: list[str], match: str,
                                                   tmp_path: Path, capsys: Any) -> None:
    argv = ["simulate", "--task", "synthetic", "--clients", "4", "--out", str(tmp_path),
            "--dp-clip", "1", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


def test_dp_flags_without_the_accountant_say_how_to_install_it(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # as if not installed
    argv = ["simulate", "--task", "synthetic", "--clients", "4", "--out", str(tmp_path),
            "--dp-clip", "1", "--dp-noise-multiplier", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install "murmura[privacy]"' in err, err


def test_a_model_with_batchnorm_buffers_is_refused() -> None:
    spec = ModelSpec((TensorSpec("w", (4,)), TensorSpec("running_mean", (4,), buffer=True)))
    cfg = ServerConfig.from_flat(require_identity=False, dp_clip=1.0, dp_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="without buffers"):
        AggregatorCore(cfg, spec, np.zeros(8, np.float32))


def test_leaves_are_refused() -> None:
    with pytest.raises(ValueError, match="a leaf's partial aggregate cannot be clipped"):
        ServerConfig.from_flat(role="leaf", upstream="127.0.0.1:1", dp_clip=1.0)


# -- gRPC ------------------------------------------------------------------------------------


@pytest.mark.integration
def test_a_grpc_server_with_dp_reaches_its_last_version(tmp_path: Path) -> None:
    import threading

    from murmura.client import ClientRuntime, GrpcTransport, TorchTrainer
    from murmura.protocols.identity import NodeKey
    from murmura.server import ServerThread

    torch.set_num_threads(1)
    tc = TaskConfig()
    cfg = ServerConfig.from_flat(min_clients=3, max_versions=3, dp_clip=1.0,
                                 dp_noise_multiplier=1.0, dp_clip_adaptive=0.5)
    core = build_core(cfg, tc, out_dir=tmp_path)
    task = load_task(tc)
    with ServerThread(core, "127.0.0.1:0") as srv:
        def client(i: int) -> None:
            trainer = TorchTrainer(task.build_model(), task.client_data(i, 3), device="cpu")
            ClientRuntime(GrpcTransport(srv.address, timeout_s=30), trainer,
                          identity=NodeKey.from_seed(f"dp-client-{i}")).run()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for th in threads:
            th.start()
        assert srv.wait_done(timeout=120)
        for th in threads:
            th.join(timeout=60)
        row = srv.call(lambda: dict(core.last_metrics))
    assert row["version"] == 3 and row["dp_sampling_rate"] == 1.0
    assert row["dp_epsilon"] == pytest.approx(library_epsilon([(1.0, 1.0, 3)], 1e-5),
                                              rel=1e-12)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
