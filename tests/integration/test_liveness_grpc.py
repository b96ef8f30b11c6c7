"""Sync cohorts over real gRPC lose their dead members fast: 10 clients train, 8 of them freeze
for good mid-task (as a killed or hung process would: no further call, no Leave), and the
rounds go on with the 2 survivors within 2x their task time instead of waiting for the round
deadline; a client whose model does not match ends its session at once."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest
import torch

from murmura.client import (
    ClientRuntime,
    FunctionTrainer,
    GrpcTransport,
    RemoteError,
    RetryPolicy,
)
from murmura.protocols import DeviceProfile, ModelSpec
from murmura.server import AggregatorCore, ServerConfig
from murmura.server.core import LOST_GRACE_S
from tests.conftest import wait_until

TASK_S = 1.0  # each task's training time (the survivors' task time is this plus a pull)


class Frozen(Exception):
    """Raised at teardown in a client that froze, to end its thread."""


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def sync_server(serve, **cfg):  # noqa: ANN001, ANN003, ANN201 - (core, running server)
    """A sync aggregator for ``model()`` on loopback, in-process decoding."""
    spec = ModelSpec.from_module(model())
    config = ServerConfig.from_flat(mode="sync", workers=0, round_deadline_s=60, **cfg)
    core = AggregatorCore(config, spec, np.zeros(spec.size, np.float32))
    return core, serve(core)


@pytest.mark.integration
def test_eight_of_ten_clients_die_and_the_rounds_go_on_with_the_survivors(serve) -> None:
    core, srv = sync_server(serve, min_clients=2, max_versions=100)
    dead, teardown = threading.Event(), threading.Event()

    def trainer(victim: bool) -> FunctionTrainer:
        def train(m: torch.nn.Module, settings: object, seed: int) -> dict[str, float]:
            if victim and dead.is_set():
                teardown.wait(120)  # frozen: no call, no Leave, until the test ends
                raise Frozen
            time.sleep(TASK_S)
            with torch.no_grad():  # a distinct small update per task (the seed differs)
                for p in m.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            return {"num_examples": 4}
        return FunctionTrainer(model(), train)

    runtimes = [ClientRuntime(GrpcTransport(srv.address, timeout_s=30), trainer(i >= 2),
                              retry=RetryPolicy(initial_s=0.05, max_s=0.5))
                for i in range(10)]
    threads = [threading.Thread(target=r.run, daemon=True) for r in runtimes]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: srv.call(lambda: core.version) >= 2, timeout=60, what="2 versions")
        dead.set()  # from now on, clients 2..9 freeze in their next task
        start = srv.call(lambda: core.version)
        published = []
        for v in range(start + 1, start + 4):
            wait_until(lambda v=v: srv.call(lambda: core.version) >= v, timeout=60,
                       what=f"version {v}")
            published.append(time.monotonic())
        survivors = {r.client_id for r in runtimes[:2]}
        task_s = srv.call(lambda: max(core.policy.task_s[c] for c in survivors))
        gaps = np.diff(published)
        # the round the victims froze in waits for their liveness bound (1.5x their task
        # time), the next ones only for the survivors: each within 2x the survivors' task time
        assert gaps.max() <= 2 * task_s, (gaps, task_s)
        assert set(srv.call(core.active_client_ids)) == survivors
        assert srv.call(lambda: core.config.policy.round_deadline_s) == 60  # not what closed them
    finally:
        teardown.set()
        srv.call(lambda: setattr(core, "done", True))  # survivors are told to stop
        for t in threads:
            t.join(timeout=30)
        for r in runtimes:
            r.transport.close()


@pytest.mark.integration
def test_a_client_for_another_model_leaves_and_the_round_does_not_wait(serve) -> None:
    core, srv = sync_server(serve, min_clients=1, max_versions=1)
    other = FunctionTrainer(torch.nn.Linear(5, 1), lambda m, s, seed: {"num_examples": 4})
    stranger = ClientRuntime(GrpcTransport(srv.address, timeout_s=10), other)
    with pytest.raises(ValueError, match="the server trains model spec"):
        stranger.run()
    stranger.transport.close()
    assert srv.call(core.active_client_ids) == []  # its session ended with the refusal
    good = ClientRuntime(GrpcTransport(srv.address, timeout_s=10),
                         FunctionTrainer(model(), lambda m, s, seed: {"num_examples": 4}))
    # (one client: its all-zero update is not a copy of anyone's)
    t0 = time.monotonic()
    good.run()
    good.transport.close()
    assert srv.call(lambda: core.version) == 1 and time.monotonic() - t0 < 10


@pytest.mark.integration
def test_a_client_whose_connection_drops_mid_wait_leaves_within_the_grace(serve) -> None:
    """A process that exits (or a connection that breaks) while its GetTask waits: gRPC cancels
    the handler, and unless the client calls again within LOST_GRACE_S its session ends."""
    core, srv = sync_server(serve, min_clients=3, require_identity=False)
    gone, stays = GrpcTransport(srv.address), GrpcTransport(srv.address)
    try:
        a = gone.join("a", DeviceProfile())[0].session
        b = stays.join("b", DeviceProfile())[0].session
        def wait_for_task() -> None:
            with contextlib.suppress(RemoteError, ValueError):  # its channel closes under it
                gone.task(a, 20)

        waiter = threading.Thread(target=wait_for_task)
        waiter.start()
        time.sleep(0.5)  # a is inside its long poll (the server re-checks twice a second)
        t0 = time.monotonic()
        gone.close()  # the connection goes: its waiting call is cancelled
        waiter.join(10)
        wait_until(lambda: srv.call(core.active_client_ids) == ["b"], timeout=10,
                   what="a's session to end")
        assert time.monotonic() - t0 < LOST_GRACE_S + 2
        assert stays.task(b, 0).action.name == "WAIT"  # b, which stayed, is untouched
    finally:
        stays.close()
