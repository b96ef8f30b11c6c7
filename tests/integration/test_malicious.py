"""Real malicious clients over loopback gRPC: a robust defence keeps the honest task."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from murmura.client import ClientRuntime, GrpcTransport, TorchTrainer
from murmura.client.malicious import make_attack
from murmura.server import ServerConfig, ServerThread, build_core
from murmura.tasks import TaskConfig, load_task

pytestmark = pytest.mark.integration

HONEST, BYZANTINE = 6, 2


def federate(defense: str) -> float:
    torch.set_num_threads(1)
    tc = TaskConfig()
    n = HONEST + BYZANTINE
    core = build_core(ServerConfig.from_flat(min_clients=n, max_versions=8, defense=defense,
                                             require_identity=False), tc,
                      out_dir=None)
    task = load_task(tc)
    with ServerThread(core, "127.0.0.1:0") as srv:
        def client(i: int) -> None:
            attack = make_attack("scale" if i >= HONEST else "", {"factor": "-20"}
                                 if i >= HONEST else {}, seed=i)
            trainer = TorchTrainer(task.build_model(), task.client_data(i, n), device="cpu")
            ClientRuntime(GrpcTransport(srv.address, timeout_s=30), trainer,
                          client_id=f"client-{i:03d}", update_hook=attack.update).run()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        assert srv.wait_done(timeout=120)
        for t in threads:
            t.join(timeout=60)
        return float(srv.call(lambda: core.last_metrics["accuracy"]))


def test_boosted_sign_flippers_break_fedavg_but_not_the_default_defence() -> None:
    undefended = federate("fedavg")
    defended = federate("default")
    assert defended > 0.85, defended
    assert undefended < defended - 0.3, (undefended, defended)


def test_malicious_modes_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown attack"):
        make_attack("teleport")
    with pytest.raises(ValueError, match="unknown option"):
        make_attack("scale", {"power": "2"})
    flipped = make_attack("label-flip", {"source": "1", "target": "7"})
    data = load_task(TaskConfig()).client_data(0, 2)
    assert not np.any(flipped.data(data).y == 1)
