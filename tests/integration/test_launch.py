"""`murmura launch`: client processes per device against a loopback server, kept alive."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from murmura.cli import main
from murmura.edge.launch import Backoff, Launcher, detect_devices
from murmura.protocols import TaskSettings
from murmura.server import ServerConfig, build_core
from murmura.tasks import TaskConfig

TASK = TaskConfig(task="digits", model="logreg", partition="iid")
CLIENT_ARGS = ["--task", "digits", "--model", "logreg", "--partition", "iid", "--threads", "1"]


def _wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        tick.wait(0.1)


@pytest.mark.integration
@pytest.mark.slow
def test_launched_clients_train_and_a_killed_one_comes_back(serve, tmp_path: Path) -> None:
    # Prepare: an async server that never finishes on its own, two CPU clients
    cfg = ServerConfig.from_flat(mode="async", buffer_size=2, max_versions=100_000, min_clients=1,
                                 workers=0, train=TaskSettings(local_steps=2, batch_size=16))
    srv = serve(build_core(cfg, TASK, out_dir=None, evaluate=False))
    launcher = Launcher(srv.address, ["cpu"], clients_per_device=2, client_index_start=3,
                        num_clients=6, client_args=CLIENT_ARGS, work_dir=tmp_path,
                        backoff=Backoff(initial_s=0.2, max_s=1.0))
    runner = threading.Thread(target=launcher.run, kwargs={"interval_s": 0.1}, daemon=True)
    runner.start()
    try:
        _wait_until(lambda: all(s.status().get("tasks", 0) >= 1 for s in launcher.slots), 120,
                    "both clients to finish a task")
        assert [s.client_id for s in launcher.slots] == ["launch-003", "launch-004"]
        victim = launcher.slots[0]
        assert victim.proc is not None
        pid, killed_at = victim.proc.pid, time.time()
        # Execute
        os.kill(pid, signal.SIGKILL)
        # Assert: restarted after its backoff, and training again
        _wait_until(lambda: victim.restarts == 1 and victim.proc is not None
                    and victim.proc.pid != pid, 30, "the killed client to restart")
        _wait_until(lambda: victim.status().get("time", 0) > killed_at, 120,
                    "the restarted client to finish a task")
        assert victim.last_error.startswith(f"exit {-signal.SIGKILL}")
        rows = {r["client"]: r for r in launcher.rows()}
        assert rows["launch-004"]["restarts"] == 0 and rows["launch-004"]["examples_per_s"] > 0
        assert "launch-003" in launcher.table() and srv.call(lambda: srv.core.version) > 0
    finally:
        launcher.stop()
        runner.join(60)
    assert not runner.is_alive() and all(s.proc is None for s in launcher.slots)


def test_devices_and_launch_options_are_checked(tmp_path: Path) -> None:
    assert detect_devices("cpu") == ["cpu"] and detect_devices("cpu,cpu") == ["cpu", "cpu"]
    assert detect_devices("auto")  # at least the CPU
    with pytest.raises(ValueError, match="unknown device"):
        detect_devices("tpu")
    with pytest.raises(ValueError, match="do not fit"):
        Launcher("h:1", ["cpu"], clients_per_device=3, client_index_start=2, num_clients=4,
                 work_dir=tmp_path)
    with pytest.raises(ValueError, match="memory_fraction"):
        Launcher("h:1", ["cpu"], memory_fraction=1.5, work_dir=tmp_path)
    assert main(["launch", "--server", "127.0.0.1:1", "--devices", "tpu"]) == 2
    if not _cuda():
        assert main(["launch", "--server", "127.0.0.1:1", "--devices", "cuda:0"]) == 2


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
