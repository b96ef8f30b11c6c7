"""build_client: the client ``murmura client`` runs, assembled in-process over any transport."""

from __future__ import annotations

import json

import pytest

from murmura.client import ClientConfig
from murmura.client.build import build_client
from murmura.client.zo import SettingsTrainer
from murmura.protocols import TaskSettings
from murmura.server import ServerConfig, build_core
from murmura.tasks import TaskConfig
from tests.client.core_transport import CoreTransport

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TASK = TaskConfig(task="digits")


def core_for(**train: object):
    settings = TaskSettings(**{"local_epochs": 1, "batch_size": 32, "lr": 0.05, **train})
    cfg = ServerConfig.from_flat(mode="async", buffer_size=1, min_clients=1, max_versions=2,
                                 require_identity=False, train=settings)
    return build_core(cfg, TASK, out_dir=None, evaluate=False)


def test_the_built_client_trains_its_share_and_logs_acknowledgements(tmp_path) -> None:
    core = core_for()
    acks = tmp_path / "acks.jsonl"
    cfg = ClientConfig(client_index=1, num_clients=4, device="cpu", profile=False,
                       ack_log=str(acks), wait_s=0)
    runtime = build_client(cfg, TASK, CoreTransport(core))
    stats = runtime.run(max_tasks=2)
    assert stats.pushed == 2 and core.version == 2
    lines = [json.loads(line) for line in acks.read_text().splitlines()]
    assert [line["version"] for line in lines] == [1, 2]
    assert isinstance(runtime.trainer.base, SettingsTrainer)  # type: ignore[attr-defined]


def test_trainer_zo_trains_zeroth_order_under_a_first_order_server() -> None:
    core = core_for()
    cfg = ClientConfig(device="cpu", profile=False, trainer="zo", zo_lr=0.001, wait_s=0)
    runtime = build_client(cfg, TASK, CoreTransport(core))
    transport = runtime.transport
    assert isinstance(transport, CoreTransport)
    runtime.run(max_tasks=1)
    (header, _), = transport.pushes
    assert header.metrics.get("zo_fallback") == 1.0


def test_a_bad_key_file_fails_before_anything_is_loaded(tmp_path) -> None:
    cfg = ClientConfig(key=str(tmp_path / "missing.key"), device="cpu")
    with pytest.raises((ValueError, OSError)):
        build_client(cfg, TASK, CoreTransport(core_for()))
