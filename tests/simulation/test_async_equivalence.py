"""Async (FedBuff) runs: the simulation and a live gRPC run fed its schedule end bit-identical.

In async mode the order of events is the outcome: the task counter numbers each training seed,
the version a client pulls is whatever was published last, and the buffer folds updates in
arrival order with their staleness weights. So the simulation is run first with every core call
its virtual clients make recorded (join, task, pull, push), and the live run — a real gRPC
aggregator on loopback decoding in worker processes, the deployment's ClientRuntime and
TorchTrainer per client in threads — is fed that schedule: each client's transport waits until
its call is next, and the next call is let through only once the previous one has returned.
Everything else (seeds, pulled versions, staleness, folds) must then follow by itself.

Torch runs on one thread here, as in the simulation (see test_equivalence.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from murmura.client import ClientRuntime, GrpcTransport, TorchTrainer, Transport
from murmura.protocols import (
    DeviceProfile,
    FlatVector,
    JoinProof,
    JoinResult,
    ModelSpec,
    PushResult,
    Task,
    TaskSettings,
    UpdateHeader,
)
from murmura.server import AggregatorCore, ServerConfig, ServerThread, build_core
from murmura.simulation import Simulation, SimulationConfig, client_id, prepare_server
from murmura.tasks import TaskConfig, load_task

pytestmark = [pytest.mark.integration, pytest.mark.slow]

T = TypeVar("T")
CLIENTS, BUFFER, VERSIONS, SEED = 6, 3, 5, 7
TASK = TaskConfig(task="digits", model="mlp", partition="dirichlet", alpha=0.5)
# int8: each client's encoder draws its stochastic rounding from its own seeded stream, and a
# worker decodes into a second shared-memory slab (a dense-f32 update is read in place)
SERVER = ServerConfig.from_flat(mode="async", buffer_size=BUFFER, max_versions=VERSIONS,
                                seed=SEED, train=TaskSettings(local_epochs=1, codec="int8"),
                                require_identity=False)  # the simulator runs without identities
# devices 10x apart in speed: fast clients push twice while slow ones train on old versions
SIM = SimulationConfig(clients=CLIENTS, vectorise="off", workers=1, speed_spread=10)
COMPARED = ("version", "round", "updates", "updates_in_version", "bytes_up", "bytes_down",
            "accuracy", "loss", "clients", "refused")
#: Longest a live call waits for its turn (the whole run takes a few seconds).
TURN_TIMEOUT_S = 60.0

Call = tuple[Any, ...]  # (client id, op, what it got)


def _outcome(op: str, result: Any) -> tuple[Any, ...]:
    """What a call got, in the same terms for the core (simulation) and the wire (live)."""
    if op == "task":
        return (result.action.name, result.seed)
    if op == "pull":
        return (result[0],)
    if op == "push":
        return (result.staleness, result.version, result.duplicate)
    return ()


# -- the simulation, recorded ------------------------------------------------------------------

def _record(core: AggregatorCore, calls: list[Call]) -> None:
    """Wrap the core methods the engine calls so each call is appended to ``calls``."""
    owner: dict[str, str] = {}  # session -> client id, learnt from join results

    def wrap(obj: Any, name: str, who: Callable[..., str], op: str,
             before: Callable[..., tuple[Any, ...]] = lambda *a: ()) -> None:
        inner = getattr(obj, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            try:
                result = inner(*args, **kwargs)
            except Exception as exc:
                calls.append((who(*args), op, *before(*args), "refused",
                              getattr(exc, "status", type(exc).__name__)))
                raise
            if op == "join":
                owner[result.session] = args[0]
            calls.append((who(*args), op, *before(*args), *_outcome(op, result)))
            return result
        setattr(obj, name, recorded)

    wrap(core, "join", lambda cid, *_: cid, "join")
    wrap(core, "task", lambda s: owner[s], "task")
    wrap(core, "model", lambda s: owner[s], "pull")
    wrap(core, "leave", lambda s: owner[s], "leave")
    wrap(core.pipeline, "push", lambda h, *_: owner[h.session], "push",
         lambda h, *_: (h.base_version,))


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The simulation's model, rows, staleness and recorded calls."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sim = Simulation(TASK, prepare_server(SERVER, SIM), SIM,
                         out_dir=tmp_path_factory.mktemp("sim"))
        calls: list[Call] = []
        _record(sim.core, calls)
        result = sim.run()
    finally:
        torch.set_num_threads(before)
    return {"params": result.params, "rows": result.rows, "staleness": result.staleness,
            "calls": calls, "decoded": sim.core.pipeline.tier.decoded}


# -- the live run, gated -----------------------------------------------------------------------

class GateError(Exception):
    """The live run left the recorded schedule (not a RemoteError: the runtime must not retry)."""


class Gate:
    """Lets the live clients' calls through one at a time, in the recorded order.

    A call waits until it is the schedule's next one and no call is in flight; the turn passes
    on when it returns. Past the end of the schedule (the run is over) calls go freely. Any
    failure breaks the gate, so every waiting client stops at once with the same message.
    """

    def __init__(self, schedule: list[tuple[str, str]], timeout_s: float = TURN_TIMEOUT_S
                 ) -> None:
        self.schedule = schedule
        self.timeout_s = timeout_s
        self.next = 0
        self.busy = False
        self.calls: list[Call] = []  # what the scheduled live calls got
        self.error = ""
        self._cond = threading.Condition()

    def _fail(self, why: str) -> GateError:
        if not self.error:
            self.error = why
        self._cond.notify_all()
        return GateError(self.error)

    def _wait_turn(self, client: str, op: str) -> bool:
        """True once it is this call's turn; False when the schedule is over."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while True:
                if self.error:
                    raise GateError(self.error)
                if self.next >= len(self.schedule):
                    return False
                expected = self.schedule[self.next]
                if not self.busy and expected == (client, op):
                    self.busy = True
                    return True
                if not self.busy and expected[0] == client:  # a client makes one call at once
                    raise self._fail(f"call {self.next}: {client} made a {op!r} call where the "
                                     f"simulation's next call is {expected}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._fail(f"{client}'s {op!r} call waited {self.timeout_s:g} s for "
                                     f"its turn; the next call in the schedule is call "
                                     f"{self.next}, {expected}")
                self._cond.wait(remaining)

    def call(self, client: str, op: str, fn: Callable[[], T], before: tuple[Any, ...] = ()
             ) -> T:
        if op == "leave" and self.error:
            return fn()  # a stopped client still ends its session
        if not self._wait_turn(client, op):
            return fn()
        try:
            result = fn()
        except Exception as exc:
            with self._cond:
                self.calls.append((client, op, *before, "refused",
                                   getattr(exc, "status", type(exc).__name__)))
                self.next, self.busy = self.next + 1, False
                self._cond.notify_all()
            raise
        with self._cond:
            self.calls.append((client, op, *before, *_outcome(op, result)))
            self.next, self.busy = self.next + 1, False
            self._cond.notify_all()
        return result


class GatedTransport(Transport):
    """The gRPC transport, each call let through by the gate when its turn comes."""

    def __init__(self, inner: GrpcTransport, gate: Gate, client: str) -> None:
        self.inner, self.gate, self.client = inner, gate, client

    def join(self, client_id: str, profile: DeviceProfile, token: str = "",
             proof: JoinProof | None = None) -> tuple[JoinResult, ModelSpec]:
        return self.gate.call(self.client, "join",
                              lambda: self.inner.join(client_id, profile, token, proof))

    def task(self, session: str, wait_s: float) -> Task:
        return self.gate.call(self.client, "task", lambda: self.inner.task(session, wait_s))

    def pull(self, session: str) -> tuple[int, FlatVector]:
        return self.gate.call(self.client, "pull", lambda: self.inner.pull(session))

    def push(self, header: UpdateHeader, payload: bytes) -> PushResult:
        return self.gate.call(self.client, "push", lambda: self.inner.push(header, payload),
                              (header.base_version,))

    def leave(self, session: str) -> None:
        self.gate.call(self.client, "leave", lambda: self.inner.leave(session))

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def serve() -> Iterator[Callable[[AggregatorCore], ServerThread]]:
    """serve(core) -> a running loopback server; stopped at teardown."""
    running: list[ServerThread] = []

    def start(core: AggregatorCore) -> ServerThread:
        srv = ServerThread(core, "127.0.0.1:0").start()
        running.append(srv)
        return srv

    yield start
    for srv in running:
        srv.stop(grace=None)


def _live_run(serve: Callable[[AggregatorCore], ServerThread], out: Path,
              schedule: list[tuple[str, str]]) -> tuple[np.ndarray, list[dict], Gate]:
    """A gRPC aggregator decoding in two worker processes; one ClientRuntime per client,
    each call gated into ``schedule``."""
    config = prepare_server(SERVER, SIM).replace(workers=2)
    task = load_task(TASK)
    core = build_core(config, TASK, out_dir=out, task=task)
    srv = serve(core)
    gate = Gate(schedule)
    errors: list[BaseException] = []

    def client(i: int) -> None:
        cid = client_id(i)
        transport = GatedTransport(GrpcTransport(srv.address, timeout_s=30), gate, cid)
        try:
            trainer = TorchTrainer(task.build_model(), task.client_data(i, CLIENTS),
                                   device="cpu")
            ClientRuntime(transport, trainer, client_id=cid, wait_s=5.0).run()
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)
        finally:
            transport.close()

    threads = [threading.Thread(target=client, args=(i,), name=f"client-{i}", daemon=True)
               for i in range(CLIENTS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 3 * TURN_TIMEOUT_S  # each turn is bounded; so is the run
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    assert not gate.error, gate.error
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a client did not finish"
    assert srv.wait_done(30), "the live run did not reach its last version"
    params = srv.call(lambda: core.params.copy())
    srv.stop()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return params, rows, gate


# -- the test ------------------------------------------------------------------------------------

def test_async_live_run_fed_the_simulated_schedule_is_bit_identical(
        simulated: dict[str, Any], serve, tmp_path: Path) -> None:
    calls, rows = simulated["calls"], simulated["rows"]
    # The schedule is asynchronous: a version every BUFFER updates, not rounds, and some
    # updates were trained on a version that was no longer current when they arrived.
    assert [r["updates_in_version"] for r in rows] == [BUFFER] * VERSIONS
    assert {r["round"] for r in rows} == {0}
    assert max(simulated["staleness"]) > 0
    pushes = [c for c in calls if c[1] == "push"]
    assert len(pushes) == BUFFER * VERSIONS and all(c[-1] is False for c in pushes)
    assert len({c[0] for c in pushes}) < len(pushes)  # some client pushed more than once

    params, live_rows, gate = _live_run(serve, tmp_path / "live", [c[:2] for c in calls])

    # Every scheduled call got what it got in the simulation: seeds, versions, staleness.
    assert gate.calls == calls
    assert params.tobytes() == simulated["params"].tobytes()
    assert [{k: r[k] for k in COMPARED} for r in live_rows] == \
        [{k: r[k] for k in COMPARED} for r in rows]
    # The live updates were decoded by the tier's worker processes; the simulation's went
    # through the tier's in-process decode, one per update.
    assert live_rows[-1]["workers"] >= 1 and live_rows[-1]["cold_starts"] >= 1
    assert live_rows[-1]["decoded"] == simulated["decoded"] == BUFFER * VERSIONS
