"""An in-memory transport: the client runtime talks to an aggregator core in the same process.

:class:`LocalAggregator` wraps one :class:`~murmura.server.AggregatorCore` behind a lock and
hands out :class:`InMemoryTransport` objects, which implement the client's
:class:`~murmura.client.Transport` interface. A :class:`~murmura.client.ClientRuntime` runs on
it unchanged (join, long-poll for tasks, pull, push, leave, retries, re-joins): the only thing
missing is the network. Refusals keep their gRPC status names (``RemoteError(status,
message)`` from the core's ``ServiceError``), and the bytes counted are the bytes the gRPC
transport would have sent.

This transport runs in real time, one thread per client; the discrete-event engine
(:mod:`murmura.simulation.engine`) drives the same core methods in virtual time instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from murmura.client import RemoteError, Transport
from murmura.protocols import (
    PROTOCOL_VERSION,
    DeviceProfile,
    FlatVector,
    JoinProof,
    JoinResult,
    ModelSpec,
    PushResult,
    Task,
    UpdateHeader,
    serde,
)
from murmura.server import AggregatorCore, ServiceError
from murmura.simulation.wire import ModelWire, update_wire_bytes

T = TypeVar("T")

#: The gRPC servicer caps a long poll at this many seconds; so does the in-memory one.
MAX_WAIT_S = 30.0


class LocalAggregator:
    """One core shared by in-memory transports; every call holds its lock.

    ``tick_s`` mirrors the gRPC server's periodic deadline check: a waiting long poll calls
    ``core.tick()`` at least that often.
    """

    def __init__(self, core: AggregatorCore, *, tick_s: float = 0.25,
                 chunk_bytes: int = serde.CHUNK_BYTES) -> None:
        self.core = core
        self.tick_s = tick_s
        self.chunk_bytes = chunk_bytes
        self.model_wire = ModelWire(core.spec, chunk_bytes=chunk_bytes)
        self._cond = threading.Condition(threading.RLock())
        core.add_listener(self._cond.notify_all)  # core calls run under the lock

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` under the lock; a refusal becomes :class:`RemoteError`."""
        with self._cond:
            try:
                return fn()
            except ServiceError as exc:
                raise RemoteError(exc.status, exc.message,
                                  retry_after_s=exc.retry_after_s) from None

    def wait_for_task(self, session: str, wait_s: float) -> Task:
        deadline = time.monotonic() + min(max(wait_s, 0.0), MAX_WAIT_S)
        with self._cond:
            while True:
                try:
                    self.core.tick()
                    task = self.core.task(session)
                except ServiceError as exc:
                    raise RemoteError(exc.status, exc.message,
                                      retry_after_s=exc.retry_after_s) from None
                remaining = deadline - time.monotonic()
                if task.action != task.action.WAIT or remaining <= 0:
                    return task
                self._cond.wait(min(remaining, self.tick_s))

    def transport(self) -> InMemoryTransport:
        return InMemoryTransport(self)


class InMemoryTransport(Transport):
    """:class:`~murmura.client.Transport` over a :class:`LocalAggregator`."""

    def __init__(self, aggregator: LocalAggregator) -> None:
        self.aggregator = aggregator
        self._bytes_up = 0

    def challenge(self) -> bytes:
        core = self.aggregator.core
        return self.aggregator.call(lambda: core.challenge()[0])

    def join(self, client_id: str, profile: DeviceProfile, token: str = "",
             proof: JoinProof | None = None) -> tuple[JoinResult, ModelSpec]:
        core = self.aggregator.core
        result = self.aggregator.call(lambda: core.join(client_id, profile, token=token,
                                                        protocol_version=PROTOCOL_VERSION,
                                                        proof=proof))
        return result, core.spec

    def task(self, session: str, wait_s: float) -> Task:
        return self.aggregator.wait_for_task(session, wait_s)

    def pull(self, session: str) -> tuple[int, FlatVector]:
        core = self.aggregator.core

        def pull() -> tuple[int, FlatVector]:
            version, params = core.model(session)
            core.add_download(self.aggregator.model_wire(version))
            return version, params

        version, params = self.aggregator.call(pull)
        return version, np.array(params, dtype=np.float32, copy=True)

    def push(self, header: UpdateHeader, payload: bytes) -> PushResult:
        core = self.aggregator.core
        wire = update_wire_bytes(header, self.aggregator.chunk_bytes)

        def push() -> PushResult:  # the push pipeline's steps, as the servicer runs them
            return core.pipeline.push(header, payload, wire_bytes=wire)

        result = self.aggregator.call(push)
        self._bytes_up += wire
        return result

    def leave(self, session: str) -> None:
        core = self.aggregator.core
        self.aggregator.call(lambda: core.leave(session))

    @property
    def bytes_up(self) -> int:
        return self._bytes_up


__all__ = ["InMemoryTransport", "LocalAggregator"]
