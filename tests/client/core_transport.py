"""A client Transport that calls an AggregatorCore directly, for client tests."""

from __future__ import annotations

from murmura.client import RemoteError
from murmura.client.transport import Transport
from murmura.server import AggregatorCore, ServiceError


class CoreTransport(Transport):
    """Calls an AggregatorCore directly; can fail the next N calls with a status."""

    def __init__(self, core: AggregatorCore) -> None:
        self.core = core
        self.failures: list[str] = []
        self.pushes: list[tuple[object, bytes]] = []

    def _maybe_fail(self) -> None:
        if self.failures:
            raise RemoteError(self.failures.pop(0), "injected")

    def _call(self, fn, *args):
        self._maybe_fail()
        try:
            return fn(*args)
        except ServiceError as exc:
            raise RemoteError(exc.status, exc.message) from None

    def challenge(self):
        return self._call(self.core.challenge)[0]

    def join(self, client_id, profile, token="", proof=None):
        return self._call(lambda: self.core.join(client_id, profile, proof=proof)), \
            self.core.spec

    def task(self, session, wait_s):
        return self._call(self.core.task, session)

    def pull(self, session):
        version, params = self._call(self.core.model, session)
        return version, params.copy()

    def push(self, header, payload):
        self.pushes.append((header, bytes(payload)))
        return self._call(self.core.push, header, payload)

    def leave(self, session):
        self._call(self.core.leave, session)

    def pull_pool_base(self, session):
        base_version, base = self._call(self.core.pool_base, session)
        return base_version, base.copy()

    def pull_pool_scalars(self, session):
        version, base_version, scalars = self._call(self.core.pool_scalars, session)
        return version, base_version, scalars.copy()


def drive(core: AggregatorCore, runtimes: list) -> None:
    """Synchronous rounds from one thread until the run is done (each runtime joins, then
    trains whenever the core gives it a task)."""
    for rt in runtimes:
        rt._call(rt._join)
    while not core.done:
        for rt in runtimes:
            task = core.task(rt.session)
            if task.action.name == "TRAIN":
                rt.step(task.round, task.seed)
