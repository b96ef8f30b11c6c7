"""FedCompass over real gRPC: the task's local steps reach the client and are trained."""

from __future__ import annotations

import threading

import pytest

from murmura.client import ClientRuntime, FunctionTrainer, GrpcTransport
from murmura.protocols import DeviceProfile, TaskSettings
from murmura.protocols.identity import NodeKey
from murmura.server import ServerConfig, build_core
from murmura.tasks import TaskConfig, load_task

pytestmark = pytest.mark.integration


def test_clients_train_the_steps_the_compass_server_assigns(serve) -> None:
    # Prepare: a fast and a slow client by their profiles; the trainer records each task's steps
    task = TaskConfig(task="digits", model="logreg", partition="iid")
    cfg = ServerConfig.from_flat(mode="compass", compass_max_steps=10, max_versions=3, workers=0,
                                 train=TaskSettings(local_steps=10, batch_size=16))
    core = build_core(cfg, task, out_dir=None, evaluate=False)
    srv = serve(core)
    model_factory = load_task(task).build_model
    seen: dict[str, list[int]] = {"fast": [], "slow": []}
    started = {"fast": threading.Event(), "slow": threading.Event()}

    def runner(name: str, steps_per_s: float) -> threading.Thread:
        def train(model, settings: TaskSettings, seed: int) -> dict[str, float]:
            seen[name].append(settings.local_steps)
            started[name].set()
            if name == "fast":  # hold the first task until slow has its own (one group)
                assert started["slow"].wait(30)
            for p in model.parameters():
                p.data.add_(0.001)
            return {"num_examples": 10}

        rt = ClientRuntime(GrpcTransport(srv.address, timeout_s=10),
                           FunctionTrainer(model_factory(seed=0), train),
                           identity=NodeKey.from_seed(name),
                           profile=DeviceProfile(steps_per_s=steps_per_s), wait_s=1.0)
        t = threading.Thread(target=rt.run, daemon=True)
        t.start()
        return t

    # Execute: fast (1 step/s) founds a group due in 10 s; slow (0.25 step/s) joins it
    threads = [runner("fast", 1.0)]
    assert started["fast"].wait(30)
    threads.append(runner("slow", 0.25))
    for t in threads:
        t.join(60)
    # Assert
    assert not any(t.is_alive() for t in threads)
    assert srv.call(lambda: core.version) == 3
    assert seen["fast"] and seen["slow"]
    assert all(2 <= q <= 10 for q in seen["fast"] + seen["slow"])
    assert seen["fast"][0] == 10 and seen["slow"][0] == 2   # same group, 4x slower
