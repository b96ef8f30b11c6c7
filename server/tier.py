"""The gateway side of the serverless aggregation tier: where a push's bytes land and who
decodes them.

``workers = 0`` keeps everything in the server's process: payloads land in reused receive
buffers and are decoded inline (tests, tiny runs). Otherwise payload bytes land once in a
shared-memory slab as they arrive, and an *aggregation function* (:func:`decode_job`) decodes
them in a worker process (or a Ray task) into a second slab; the gateway only passes slab
references. Workers start when updates arrive, grow with the backlog up to ``max_workers`` and
stop when idle (``server/workers.py``). When slabs or the job queue are full the push is refused
with RESOURCE_EXHAUSTED and a retry hint: back-pressure, never a silent drop.

The decoded update stays in its slab until the publisher has folded it; the fold's ``release``
callback returns the slabs to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from murmura.protocols import FlatVector, UpdateHeader
from murmura.server.buffers import DEFAULT_MAX_FREE, BufferPool, ReceiveBuffer
from murmura.server.config import ServerConfig
from murmura.server.decoding import Decoded, Decoder
from murmura.server.errors import ResourceExhausted
from murmura.server.slabs import OutRef, Slab, SlabPool, SlabRef, attach
from murmura.server.workers import FunctionBackend, QueueFull

log = logging.getLogger(__name__)

#: Suggested pause before a push refused for back-pressure is retried.
RETRY_AFTER_S = 0.5
#: Published versions kept in shared memory for reference-needing codecs (seed replay).
REFERENCE_SLABS = 3


@dataclass(frozen=True)
class DecodedMeta:
    """What a worker sends back instead of the decoded arrays (they are in the output slab)."""

    in_place: bool        # the values are the payload itself (dense-f32): no copy was made
    n_values: int         # float32 values (0 for an exact partial)
    weight: float | None
    count: int
    exact: bool


def decode_job(decoder: Decoder, codec: str, payload: SlabRef | bytes, reference: Any,
               out: OutRef | None) -> DecodedMeta | Decoded:
    """The aggregation function: decode one payload wherever this runs.

    ``payload`` and ``reference`` are slab references (local workers) or bytes/arrays (Ray,
    inline). With an ``out`` slab the arrays are written there and only a small
    :class:`DecodedMeta` travels back; without one (Ray) the :class:`Decoded` itself returns.
    """
    data = attach(payload) if isinstance(payload, SlabRef) else payload
    ref = reference
    if isinstance(reference, SlabRef):
        ref = np.frombuffer(attach(reference), dtype=np.float32, count=decoder.size)
    decoded = decoder.decode(codec, data, reference=ref)
    if out is None:
        if decoded.values is not None and not decoded.values.flags.owndata:
            decoded.values = np.array(decoded.values, copy=True)  # not a view of a slab
        return decoded
    target = attach(out)
    in_place = codec == "dense-f32" and decoded.limbs is None
    n_values = 0
    if decoded.limbs is not None:
        hi, lo = decoded.limbs
        np.frombuffer(target, dtype=np.int64, count=hi.size)[:] = hi
        np.frombuffer(target, dtype=np.int64, count=lo.size, offset=hi.nbytes)[:] = lo
    elif decoded.values is not None:
        n_values = decoded.values.size
        if not in_place:
            np.frombuffer(target, dtype=np.float32, count=n_values)[:] = decoded.values
    return DecodedMeta(in_place=in_place, n_values=n_values, weight=decoded.weight,
                       count=decoded.count, exact=decoded.limbs is not None)


class Tier:
    """Receive buffers, dispatch to aggregation functions, back-pressure, statistics."""

    def __init__(self, config: ServerConfig, decoder: Decoder, *,
                 backend: FunctionBackend | None = None) -> None:
        self.config = config
        self.decoder = decoder
        self.backend = backend
        self.inline = backend is None
        #: workers = 0: reused receive buffers, as the gateway had before the tier.
        self.buffers = BufferPool(DEFAULT_MAX_FREE)
        self.slabs = None if self.inline else SlabPool(int(config.slab_mb * (1 << 20)))
        self._references: OrderedDict[int, Slab] = OrderedDict()
        self._ref_users: dict[int, int] = {}     # decodes in flight per reference version
        self._retired: dict[int, Slab] = {}      # dropped from the cache, still being read
        self.decoded = 0
        self.decode_s = 0.0

    @classmethod
    def for_config(cls, config: ServerConfig, decoder: Decoder) -> Tier:
        """The backend ``config`` asks for (none for ``workers = 0``)."""
        if config.workers == 0:
            return cls(config, decoder)
        limit = config.worker_limit
        backend: FunctionBackend
        if config.backend == "ray":
            from murmura.server.raybackend import RayBackend

            backend = RayBackend(config.ray_address or None, max_in_flight=config.max_queue)
        else:
            from murmura.server.workers import ProcessBackend

            backend = ProcessBackend(limit, idle_s=config.worker_idle_s,
                                     max_queue=config.max_queue,
                                     preload=("murmura.server.tier",))
        return cls(config, decoder, backend=backend)

    # -- receiving ----------------------------------------------------------------------------

    def receive(self, nbytes: int) -> ReceiveBuffer | Slab:
        """Where a push's payload lands; refused with a retry hint when memory is exhausted."""
        if self.slabs is None:
            return self.buffers.acquire(nbytes)
        slab = self.slabs.acquire(nbytes)
        if slab is None:
            raise self._busy(f"{self.slabs.in_use_bytes / 1e6:.0f} MB of updates are in "
                             f"flight (slab_mb={self.config.slab_mb:g})")
        return slab

    @staticmethod
    def write(lease: ReceiveBuffer | Slab, offset: int, data: memoryview) -> None:
        if isinstance(lease, ReceiveBuffer):
            lease.write(offset, data)
        else:
            lease.buf[offset:offset + len(data)] = data

    @staticmethod
    def view(lease: ReceiveBuffer | Slab, nbytes: int) -> memoryview:
        if isinstance(lease, ReceiveBuffer):
            return lease.view
        return lease.buf[:nbytes]

    def discard(self, lease: ReceiveBuffer | Slab) -> None:
        """The push ended before decoding: give the buffer back."""
        if isinstance(lease, ReceiveBuffer):
            self.buffers.release(lease)
        elif self.slabs is not None:
            self.slabs.release(lease)

    @staticmethod
    def _busy(why: str) -> ResourceExhausted:
        return ResourceExhausted(f"the aggregator is busy: {why}; retry in {RETRY_AFTER_S:g} s",
                                 retry_after_s=RETRY_AFTER_S)

    # -- decoding -----------------------------------------------------------------------------

    async def decode(self, header: UpdateHeader, lease: ReceiveBuffer | Slab,
                     reference: FlatVector | None, reference_version: int
                     ) -> tuple[Decoded, Callable[[], None]]:
        """Decode the payload in ``lease``; returns the update and its ``release`` callback.

        The lease belongs to the tier from here on, also when decoding fails.
        """
        t0 = time.perf_counter()
        if self.backend is None:
            assert isinstance(lease, ReceiveBuffer)
            try:
                decoded = self.decoder.decode(header.codec, lease.view, reference=reference)
            except BaseException:
                self.buffers.release(lease)
                raise
            self._count(t0)
            return decoded, lambda: self.buffers.release(lease)
        assert isinstance(lease, Slab) and self.slabs is not None
        slabs = self.slabs
        out = slabs.acquire(self.decoder.decoded_nbytes(header.codec))
        if out is None:
            slabs.release(lease)
            raise self._busy(f"{slabs.in_use_bytes / 1e6:.0f} MB of updates are in flight")
        ref_arg: Any = None
        if reference is not None:
            try:
                ref_arg = self._reference_slab(reference_version, reference).ref(
                    0, reference.nbytes)
            except ResourceExhausted:
                slabs.release(lease)
                slabs.release(out)
                raise
            self._ref_users[reference_version] = self._ref_users.get(reference_version, 0) + 1
        job = asyncio.ensure_future(self.backend.run(
            decode_job, self.decoder, header.codec, lease.ref(0, header.payload_bytes), ref_arg,
            OutRef(out.name, 0, out.size)))
        try:
            meta = await asyncio.shield(job)
        except asyncio.CancelledError:
            # The client went away; the worker may still be writing into the slabs, so they
            # go back to the pool only once its job has ended.
            def later(_: Any) -> None:
                slabs.release(lease)
                slabs.release(out)
                if ref_arg is not None:
                    self._drop_reference_user(reference_version)
            job.add_done_callback(later)
            ref_arg = None
            raise
        except QueueFull as exc:
            slabs.release(lease)
            slabs.release(out)
            raise self._busy(str(exc)) from None
        except BaseException:
            slabs.release(lease)
            slabs.release(out)
            raise
        finally:
            if ref_arg is not None:
                self._drop_reference_user(reference_version)
        self._count(t0)
        decoded = self._rebuild(meta, lease, out, header.payload_bytes)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                slabs.release(lease)
                slabs.release(out)
        return decoded, release

    def _count(self, t0: float) -> None:
        self.decoded += 1
        self.decode_s += time.perf_counter() - t0

    def _rebuild(self, meta: DecodedMeta | Decoded, lease: Slab, out: Slab,
                 payload_bytes: int) -> Decoded:
        if isinstance(meta, Decoded):  # a backend that returns the arrays (Ray)
            arrays = meta
            if arrays.values is not None:
                view = np.frombuffer(out.buf, dtype=np.float32, count=arrays.values.size)
                view[:] = arrays.values
                arrays.values = view
            return arrays
        if meta.exact:
            n = self.decoder.size
            hi = np.frombuffer(out.buf, dtype=np.int64, count=n)
            lo = np.frombuffer(out.buf, dtype=np.int64, count=n, offset=8 * n)
            return Decoded(None, weight=meta.weight, count=meta.count, limbs=(hi, lo))
        source = lease.buf[:payload_bytes] if meta.in_place else out.buf
        values = np.frombuffer(source, dtype=np.float32, count=meta.n_values)
        return Decoded(values, weight=meta.weight, count=meta.count)

    def _reference_slab(self, version: int, params: FlatVector) -> Slab:
        """Version ``version`` in shared memory, copied once and kept for a few versions."""
        slab = self._references.get(version)
        if slab is None:
            assert self.slabs is not None
            slab = self.slabs.acquire(params.nbytes)
            if slab is None:
                raise self._busy("no shared memory is left for the reference model")
            np.frombuffer(slab.buf, dtype=np.float32, count=params.size)[:] = params
            self._references[version] = slab
            while len(self._references) > REFERENCE_SLABS:
                old_version, old = self._references.popitem(last=False)
                if self._ref_users.get(old_version, 0):
                    self._retired[old_version] = old  # a decode still reads it
                else:
                    self.slabs.release(old)
        return slab

    def _drop_reference_user(self, version: int) -> None:
        users = self._ref_users.get(version, 0) - 1
        if users > 0:
            self._ref_users[version] = users
            return
        self._ref_users.pop(version, None)
        retired = self._retired.pop(version, None)
        if retired is not None and self.slabs is not None:
            self.slabs.release(retired)

    # -- status -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Figures for the metrics row and the log: workers, queue, cold starts, decode time."""
        out: dict[str, Any] = {"decoded": self.decoded,
                               "decode_ms": round(1e3 * self.decode_s / max(self.decoded, 1), 3)}
        if self.backend is not None:
            s = self.backend.stats()
            out.update({"workers": s.get("workers", 0), "queue": s.get("queue", 0),
                        "cold_starts": s.get("cold_starts", 0)})
        if self.slabs is not None:
            out["slab_mb_in_use"] = round(self.slabs.in_use_bytes / 1e6, 1)
        return out

    async def close(self) -> None:
        if self.backend is not None:
            await self.backend.close()
        if self.slabs is not None:
            self._references.clear()
            self.slabs.close()


__all__ = ["RETRY_AFTER_S", "DecodedMeta", "Tier", "decode_job"]
