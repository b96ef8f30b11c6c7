"""Receiver processes: pushes received outside the gateway process.

Receiving a push is the gateway's largest serial cost: gRPC's HTTP/2 framing and message
handling of a 10 MB int8 update take ~14 ms of one process's CPU, more than its decode in a
worker (serverless benchmark). With ``--receivers N`` that work runs in N processes that
share one port (``--push-port``; SO_REUSEPORT lets the kernel spread connections over them),
and the gateway keeps only what must be serial:

1. a receiver reads a push's header chunk and asks the gateway (a Unix socket, one request
   of a few hundred bytes) to check it: the gateway runs the pipeline's *precheck* and lends
   a slab of the tier's shared memory for the payload, or answers the refusal;
2. the receiver copies the payload chunks straight into that slab (mapped in its own
   process), as the gateway would have; where the workers fold int8, int4 and top-k updates
   straight from their payloads, it also runs the payload check a worker would
   (``tier.check_payload_job``: format, finiteness, the payload's hash for signatures);
3. it hands the slab back with the byte counts (and the check's outcome); the gateway runs
   the rest of the one push pipeline (``PushPipeline.complete``: duplicates, spool, decode in
   a worker unless checked, fold, durability) and answers with the result, which the
   receiver returns to the client.

Clients learn the port from Join (``JoinReply.push_port``) and push there; every other call,
and a push retried after the port failed, goes to the gateway, which still serves Push. A
receiver that dies is started again on the same port; the slabs it held are given back when
its link to the gateway closes, and its clients' retries are answered (a taken update as a
duplicate). Receivers speak the server's TLS, and only a process that knows the hub's random
token (passed to the receivers at start, never on disk) may use the hub's socket, which lives
in a directory only the server's user can open.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from murmura.protocols import UpdateHeader, serde
from murmura.server.errors import ServiceError, Unavailable
from murmura.server.receiver_process import Frames, TlsFiles, send_message
from murmura.server.slabs import Slab
from murmura.server.tier import DecodedMeta

if TYPE_CHECKING:
    from murmura.server.service import AggregatorServicer

__all__ = ["ReceiverHub", "TlsFiles"]

log = logging.getLogger(__name__)

#: How long a receiver may take to start and bind its port.
START_TIMEOUT_S = 60.0
#: Wait before starting a receiver that died again, doubled per quick death up to the cap.
RESTART_S, RESTART_CAP_S = 0.5, 30.0

# -- the gateway's side --------------------------------------------------------------------


class _Link:
    """One receiver's connection to the hub, and the slabs lent to it."""

    def __init__(self, writer: asyncio.WriteTransport) -> None:
        self.writer = writer
        self.index = -1
        self.ready = False  # it said it serves; a death before that is _spawn's to report
        self.leases: dict[int, tuple[UpdateHeader, Slab, float]] = {}  # ..., opened at
        self.inflight: set[int] = set()    # request ids of completes being run
        self.cancelled: set[int] = set()   # ... whose client went away
        self.tasks: set[asyncio.Task[None]] = set()


class _HubProtocol(asyncio.Protocol):
    """One receiver's link, read as bytes arrive (server/receiver_process.py's framing)."""

    def __init__(self, hub: ReceiverHub) -> None:
        self.hub = hub
        self.frames = Frames()
        self.link: _Link | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.link = _Link(transport)

    def data_received(self, data: bytes) -> None:
        assert self.link is not None
        try:
            for message in self.frames.feed(data):
                self.hub._on_message(self.link, message)
        except Exception:  # noqa: BLE001 - a broken link ends that receiver, not the server
            log.exception("receiver %d's link failed", self.link.index)
            self.link.writer.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.link is not None:
            self.hub._on_close(self.link)


class ReceiverHub:
    """Starts the receiver processes and answers them on the gateway's event loop.

    ``servicer`` is the gateway's: its pipeline and tier take the receivers' pushes exactly
    as its own Push does. ``host`` is the address the receivers bind (the server's host).
    """

    def __init__(self, servicer: AggregatorServicer, count: int, *, host: str,
                 port: int = 0, tls: TlsFiles | None = None,
                 max_message_bytes: int = 4 * serde.CHUNK_BYTES) -> None:
        if count < 1:
            raise ValueError(f"a receiver hub needs at least one receiver, got {count}")
        self.servicer = servicer
        self.pipeline = servicer.pipeline
        self.tier = servicer.tier
        self.count = count
        self.host = host
        self.requested_port = port
        self.port = 0
        self.tls = tls
        self.max_message_bytes = max_message_bytes
        self._token = secrets.token_hex(16)
        self._dir = ""
        self._path = ""
        self._server: asyncio.AbstractServer | None = None
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._ready: dict[int, asyncio.Future[int]] = {}
        self._links: set[_Link] = set()
        self._restart_wait: dict[int, float] = {}
        self._started: dict[int, float] = {}
        self._restarts: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self._stopping = False
        self.pushes = 0
        self.checks = 0  # pushes whose payload a receiver checked instead of a worker
        self.restarts = 0

    @property
    def pids(self) -> list[int]:
        """The live receivers' process ids (benchmarks read their CPU)."""
        return [p.pid for p in self._procs.values() if p.poll() is None]

    async def start(self) -> int:
        """Start the receivers; returns their port once every one has bound it."""
        self._dir = tempfile.mkdtemp(prefix="murmura-receivers-")  # mode 0700
        self._path = os.path.join(self._dir, "hub.sock")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _HubProtocol(self),
                                                     path=self._path)
        try:
            # the first picks the port (any free one for push_port 0); the rest share it
            self.port = await self._spawn(0, self.requested_port)
            for index in range(1, self.count):
                await self._spawn(index, self.port)
        except BaseException:
            await self.stop()
            raise
        log.info("%d receiver process%s take pushes on %s:%d", self.count,
                 "" if self.count == 1 else "es", self.host, self.port)
        return self.port

    async def _spawn(self, index: int, port: int) -> int:
        loop = asyncio.get_running_loop()
        ready = self._ready[index] = loop.create_future()
        # A fresh interpreter running this module: it imports neither the server's main
        # script nor anything the gateway set up; its settings (the token too) come on stdin.
        proc = subprocess.Popen([sys.executable, "-m", "murmura.server.receiver_process"],
                                stdin=subprocess.PIPE, close_fds=True)
        assert proc.stdin is not None
        settings = {"index": index, "hub": self._path, "token": self._token,
                    "host": self.host, "port": port, "max_message_bytes": self.max_message_bytes,
                    "tls": dataclasses.asdict(self.tls) if self.tls is not None else None}
        proc.stdin.write(json.dumps(settings).encode() + b"\n")
        proc.stdin.close()
        self._procs[index] = proc
        self._started[index] = time.monotonic()
        deadline = loop.time() + START_TIMEOUT_S
        while not ready.done():  # the process may die before it says it is ready
            if proc.poll() is not None:  # its traceback is on stderr
                raise ValueError(f"--push-port: receiver {index} could not serve "
                                 f"{self.host}:{port} (exit code {proc.returncode}; is the port "
                                 f"in use by another program?)")
            if loop.time() > deadline:
                proc.kill()
                raise RuntimeError(f"receiver {index} did not bind {self.host}:{port} within "
                                   f"{START_TIMEOUT_S:g} s")
            await asyncio.wait({ready}, timeout=0.05)
        return ready.result()

    def _on_message(self, link: _Link, message: tuple[Any, ...]) -> None:
        if link.index >= 0:
            self._dispatch(link, message)
            return
        if message[0] != "hello" or len(message) != 4 \
                or not secrets.compare_digest(str(message[2]), self._token):
            log.warning("a process without the hub's token connected to the receivers' "
                        "socket; closed")
            link.writer.close()
            return
        link.index = int(message[3])
        self._links.add(link)
        # Where the workers fold int8/int4/top-k payloads straight from the slab, the
        # receiver checks them too, as a worker would (tier.check_payload_job): one job less
        # per update on the gateway.
        send_message(link.writer, ("ok", message[1],
                                   self.tier.decoder if self.tier.fuse else None))

    def _on_close(self, link: _Link) -> None:
        self._links.discard(link)
        for _, slab, _ in link.leases.values():  # payloads it was still receiving
            self.tier.discard(slab)
        link.leases.clear()
        if link.ready and not self._stopping:
            self._respawn(link.index)

    def _dispatch(self, link: _Link, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "open":
            self._open(link, message[1], message[2])
        elif kind == "complete":
            link.inflight.add(message[1])
            task = asyncio.create_task(self._complete(link, *message[1:6]))
            link.tasks.add(task)
            task.add_done_callback(link.tasks.discard)
        elif kind == "discard":
            taken = link.leases.pop(message[1], None)
            if taken is not None:
                self.tier.discard(taken[1])
        elif kind == "cancel":
            if message[1] in link.inflight:
                link.cancelled.add(message[1])
        elif kind == "refused":  # refused in the receiver (a malformed stream): counted here
            self._refused(message[1])
        elif kind == "ready":
            link.ready = True
            future = self._ready.get(link.index)
            if future is not None and not future.done():
                future.set_result(int(message[1]))
        else:
            raise ConnectionError(f"unknown hub message {kind!r}")

    def _refused(self, exc: ServiceError) -> None:
        self.servicer.log_limit.log(exc.status, "push refused: %s %s", exc.status, exc.message)
        self.servicer.core.count_refusal(exc)

    def _open(self, link: _Link, rid: int, header: UpdateHeader) -> None:
        """Precheck a header and lend the slab its payload lands in."""
        try:
            if not isinstance(header, UpdateHeader):
                raise ConnectionError("an open request without an update header")
            self.pipeline.precheck(header)
            slab = self.pipeline.receive(header.payload_bytes)
        except ServiceError as exc:
            self._refused(exc)
            send_message(link.writer, ("err", rid, exc))
            return
        except Exception as exc:  # noqa: BLE001 - answered, and the server carries on
            log.exception("a push header from receiver %d could not be checked", link.index)
            send_message(link.writer, ("err", rid, Unavailable(f"the push failed: "
                                                        f"{type(exc).__name__}")))
            return
        if not isinstance(slab, Slab):  # an in-process tier has no shared memory
            self.tier.discard(slab)
            send_message(link.writer, ("err", rid, Unavailable("the tier has no shared memory")))
            return
        lease_id = next(self._ids)
        link.leases[lease_id] = (header, slab, time.perf_counter())
        send_message(link.writer, ("ok", rid, (lease_id, slab.name, slab.size)))

    async def _complete(self, link: _Link, rid: int, lease_id: int, received: int,
                        wire: int, checked: DecodedMeta | ServiceError | None) -> None:
        """The rest of the pipeline for a payload a receiver landed (and perhaps checked);
        answers the result."""
        taken = link.leases.pop(lease_id, None)
        try:
            if taken is None:
                raise ConnectionError(f"receiver {link.index} completed an unknown lease")
            header, slab, opened = taken
            if not 0 <= received <= slab.size:
                self.tier.discard(slab)
                raise ConnectionError(f"receiver {link.index} landed {received} bytes in a "
                                      f"slab of {slab.size}")
            self.pushes += 1
            self.checks += checked is not None
            result = await self.pipeline.complete(
                header, slab, received, wire, cancelled=lambda: rid in link.cancelled,
                at=self.servicer._at, checked=checked)
            reply: tuple[Any, ...] = ("ok", rid, result)
            # the RPC latency histogram's Push, from the header's check to the answer
            self.servicer.core.telemetry.observe_rpc("Push", time.perf_counter() - opened)
        except ServiceError as exc:
            self._refused(exc)
            reply = ("err", rid, exc)
        except asyncio.CancelledError:
            reply = ("err", rid, Unavailable("the push was cancelled; retry it"))
        except Exception as exc:  # noqa: BLE001 - answered, and the server carries on
            log.exception("a push from receiver %d failed", link.index)
            reply = ("err", rid, Unavailable(f"the push failed: {type(exc).__name__}"))
        finally:
            link.inflight.discard(rid)
            link.cancelled.discard(rid)
        if not link.writer.is_closing():
            send_message(link.writer, reply)

    def _respawn(self, index: int) -> None:
        """Start receiver ``index`` again after a wait that doubles while it keeps dying
        within a minute of its start."""
        proc = self._procs.get(index)
        code = proc.poll() if proc is not None else None
        if time.monotonic() - self._started.get(index, 0.0) > 60.0:
            self._restart_wait.pop(index, None)
        wait = self._restart_wait.get(index, RESTART_S)
        self._restart_wait[index] = min(2 * wait, RESTART_CAP_S)
        log.warning("receiver %d stopped (exit code %s); starting it again in %.1f s", index,
                    code, wait)

        async def again() -> None:
            await asyncio.sleep(wait)
            if self._stopping:
                return
            if proc is not None:
                await _reap(proc, 1.0)
            try:
                await self._spawn(index, self.port)
                self.restarts += 1
            except Exception as exc:  # noqa: BLE001 - tried again after a longer wait
                log.error("receiver %d could not be started again: %s", index, exc)
                if not self._stopping:
                    self._respawn(index)

        task = asyncio.create_task(again())
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    def stats(self) -> dict[str, Any]:
        """For the metrics rows: live receivers, restarts, pushes they brought."""
        alive = sum(1 for link in self._links if link.index >= 0)
        return {"receivers": alive, "receiver_restarts": self.restarts,
                "receiver_pushes": self.pushes, "receiver_checks": self.checks}

    async def stop(self) -> None:
        """Stop the receivers (they finish their calls within a second) and the hub."""
        self._stopping = True
        for task in list(self._restarts):
            task.cancel()
        for link in list(self._links):
            link.writer.close()  # a receiver stops when its link closes
        for proc in self._procs.values():
            await _reap(proc, 5.0)
        self._procs.clear()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""


async def _reap(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """Wait up to ``grace_s`` for a receiver to exit, then kill it; never blocks the loop."""
    deadline = time.monotonic() + grace_s
    while proc.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
        await asyncio.get_running_loop().run_in_executor(None, proc.wait)


