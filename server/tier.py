"""The gateway side of the serverless aggregation tier: where a push's bytes land and who
decodes them.

``workers = 0`` keeps everything in the server's process: payloads land in reused receive
buffers and are decoded inline (tests, tiny runs). Otherwise payload bytes land once in a
shared-memory slab as they arrive, and an *aggregation function* (:func:`decode_job`) decodes
them in a worker process (or a Ray task) into a second slab; the gateway only passes slab
references. Workers start when updates arrive, grow with the backlog up to ``max_workers`` and
stop when idle (``server/process_backend.py``). When slabs or the job queue are full the push is
refused with RESOURCE_EXHAUSTED and a retry hint: back-pressure, never a silent drop.

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
import torch

from murmura.protocols import FlatVector, UpdateHeader
from murmura.protocols.codecs.partial import KIND_EXACT, PARTIAL_CODEC
from murmura.server.buffers import DEFAULT_MAX_FREE, BufferPool, ReceiveBuffer
from murmura.server.config import TierConfig
from murmura.server.decoding import Decoded, Decoder
from murmura.server.errors import ResourceExhausted, ServiceError
from murmura.server.slabs import (
    OutArray,
    OutRef,
    Slab,
    SlabPool,
    SlabRef,
    attach,
    resolve,
    write_out,
)
from murmura.server.workers import FunctionBackend, QueueFull

log = logging.getLogger(__name__)

#: Suggested pause before a push refused for back-pressure is retried.
RETRY_AFTER_S = 0.5
#: Published versions kept in shared memory for reference-needing codecs (seed replay).
REFERENCE_SLABS = 3
DENSE = "dense-f32"
#: Idle slabs kept per size class (the slab cap still bounds the total).
IDLE_SLABS_PER_CLASS = 32


@dataclass(frozen=True)
class DecodedMeta:
    """What a worker sends back instead of the decoded arrays (they are in the output slab)."""

    in_place: bool        # the values are the payload itself (dense-f32): no copy was made
    n_values: int         # float32 values (0 for an exact partial)
    weight: float | None
    count: int
    exact: bool
    max_abs: float = 0.0  # the core bounds each version's aggregate with it
    payload_sha256: bytes | None = None  # set when the run checks update signatures


def decode_job(decoder: Decoder, codec: str, payload: SlabRef | bytes, reference: Any,
               out: OutRef | None) -> DecodedMeta | OutArray:
    """The aggregation function: decode one payload wherever this runs.

    ``payload`` and ``reference`` are slab references (local workers) or the bytes a remote
    backend shipped in their place. The decoded arrays go into ``out``, exactly
    :func:`output_nbytes` long, and only a small :class:`DecodedMeta` travels back; a remote
    backend passes ``out=None`` and copies the returned array into the slab itself
    (:func:`~murmura.server.slabs.write_out`). For dense-f32 the values *are* the payload, so
    ``out`` is the payload's own range and a local worker writes nothing.
    """
    torch.set_num_threads(1)  # one core per worker; the pool, not torch, uses the others
    data = resolve(payload)
    ref = None
    if reference is not None:
        ref = np.frombuffer(resolve(reference), dtype=np.float32, count=decoder.size)
    target = None
    if out is not None and codec not in (DENSE, PARTIAL_CODEC) and decoder.pool is None:
        target = np.frombuffer(attach(out), dtype=np.float32, count=decoder.size)
    decoded = decoder.decode(codec, data, reference=ref, out=target)
    exact = decoded.limbs is not None
    if exact:
        hi, lo = decoded.limbs  # type: ignore[misc]
        array = np.concatenate([hi.view(np.uint8), lo.view(np.uint8)])
        n_values = 0
    else:
        assert decoded.values is not None
        array, n_values = decoded.values, decoded.values.size
    meta = DecodedMeta(in_place=codec == DENSE and not exact, n_values=n_values,
                       weight=decoded.weight, count=decoded.count, exact=exact,
                       max_abs=decoded.max_abs, payload_sha256=decoded.payload_sha256)
    if out is not None and (meta.in_place or array is target):
        return meta  # the values are in the payload's or the output's slab already
    return write_out(out, array, meta)


def check_payload_job(decoder: Decoder, codec: str,
                      payload: SlabRef | bytes | memoryview) -> DecodedMeta:
    """The aggregation function for an update that a worker will fold straight from its
    payload (server/folds.py): check it as decoding would, write nothing."""
    torch.set_num_threads(1)
    decoded = decoder.check(codec, resolve(payload))
    return DecodedMeta(in_place=False, n_values=0, weight=None, count=1, exact=False,
                       max_abs=decoded.max_abs, payload_sha256=decoded.payload_sha256)


def output_nbytes(decoder: Decoder, codec: str, head: bytes | memoryview) -> int:
    """How many bytes :func:`decode_job` writes for a payload that starts with ``head``."""
    if codec == PARTIAL_CODEC:
        exact = len(head) >= 4 and head[3] == KIND_EXACT
        return (16 if exact else 4) * decoder.size
    return 4 * decoder.update_size


class Tier:
    """Receive buffers, dispatch to aggregation functions, back-pressure, statistics."""

    def __init__(self, config: TierConfig, decoder: Decoder, *,
                 backend: FunctionBackend | None = None) -> None:
        self.config = config
        self.decoder = decoder
        self.backend = backend
        self.inline = backend is None
        #: workers = 0: reused receive buffers, as the gateway had before the tier, and reused
        #: decoder outputs (a fresh 40 MB output for a 10M-value int8 update cost 3.7 ms of page
        #: faults, as much as decoding it into mapped pages).
        self.buffers = BufferPool(DEFAULT_MAX_FREE)
        self.outputs = BufferPool(DEFAULT_MAX_FREE)
        # Idle slabs are kept (up to the cap): a new slab costs page faults in the gateway and
        # in every worker that attaches it, a recycled one nothing.
        self.slabs = None if self.inline else SlabPool(int(config.slab_mb * (1 << 20)),
                                                       idle_per_class=IDLE_SLABS_PER_CLASS)
        self._references: OrderedDict[int, Slab] = OrderedDict()
        self._ref_users: dict[int, int] = {}     # decodes in flight per reference version
        self._retired: dict[int, Slab] = {}      # dropped from the cache, still being read
        self.decoded = 0
        self.decode_s = 0.0
        #: Check fusable payloads (int8, int4, top-k) instead of decoding them: set by the
        #: server when workers fold the updates straight from their payloads (server/folds.py).
        self.fuse = False
        #: Runs a function on the gateway's event loop (set by the server): in-process receive
        #: buffers are released there, after the push handler has dropped its references.
        self.post: Callable[[Callable[[], object]], object] = lambda fn: fn()

    @classmethod
    def for_config(cls, config: TierConfig, decoder: Decoder) -> Tier:
        """The backend ``config`` asks for (none for ``workers = 0``)."""
        if config.workers == 0:
            return cls(config, decoder)
        limit = config.worker_limit
        backend: FunctionBackend
        if config.backend == "ray":
            from murmura.server.raybackend import RayBackend

            backend = RayBackend(config.ray_address or None, max_in_flight=config.max_queue)
        else:
            from murmura.server.process_backend import ProcessBackend

            backend = ProcessBackend(limit, idle_s=config.worker_idle_s,
                                     max_queue=config.max_queue,
                                     preload=("murmura.server.tier",
                                              "murmura.server.folds",
                                              "murmura.server.columns",
                                              "murmura.server.worker_process"))
        return cls(config, decoder, backend=backend)

    # -- receiving ----------------------------------------------------------------------------

    def receive(self, nbytes: int) -> ReceiveBuffer | Slab:
        """Where a push's payload lands; refused with a retry hint when memory is exhausted."""
        if self.slabs is None:
            return self.buffers.acquire(nbytes)
        slab = self._acquire(nbytes)
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

    def _acquire(self, nbytes: int) -> Slab | None:
        """A slab, None while the cap is in use, or a refusal for a size that never fits."""
        assert self.slabs is not None
        try:
            return self.slabs.acquire(nbytes)
        except ValueError:
            raise ResourceExhausted(f"{nbytes / 1e6:.0f} MB does not fit the aggregator's "
                                    f"shared memory at all (slab_mb={self.config.slab_mb:g}); "
                                    f"the operator must raise slab_mb") from None

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

    def _inline_output(self, codec: str) -> ReceiveBuffer | None:
        """A reused output for an inline decode that writes a model-sized vector, else None
        (dense-f32 is a view of its payload; partials and seed-pool updates are not
        model-sized; small models allocate cheaply)."""
        nbytes = 4 * self.decoder.size
        if codec in (DENSE, PARTIAL_CODEC) or self.decoder.pool is not None \
                or nbytes < self.outputs.min_bytes:
            return None
        return self.outputs.acquire(nbytes)

    async def decode(self, header: UpdateHeader, lease: ReceiveBuffer | Slab,
                     reference: FlatVector | None, reference_version: int, *,
                     checked: DecodedMeta | ServiceError | None = None
                     ) -> tuple[Decoded, Callable[[], None]]:
        """Decode the payload in ``lease``; returns the update and its ``release`` callback.

        The lease belongs to the tier from here on, also when decoding fails. ``checked``: a
        receiver process already ran :func:`check_payload_job` on this payload (the update
        will be folded from it), and this is its outcome; no worker checks it again.
        """
        if self.backend is None:
            return self.decode_inline(header, lease, reference)
        t0 = time.perf_counter()
        assert isinstance(lease, Slab) and self.slabs is not None
        slabs = self.slabs
        payload = lease.buf[:header.payload_bytes]
        if self.fuse and self.decoder.fusable(header.codec):
            return await self._check(header, lease, t0, checked)
        out_bytes = output_nbytes(self.decoder, header.codec, payload[:24])
        if header.codec == DENSE:
            out, out_ref = None, OutRef(lease.name, 0, header.payload_bytes)
        else:
            try:
                out = self._acquire(out_bytes)
            except ResourceExhausted:
                slabs.release(lease)
                raise
            if out is None:
                slabs.release(lease)
                raise self._busy(f"{slabs.in_use_bytes / 1e6:.0f} MB of updates are in flight")
            out_ref = OutRef(out.name, 0, out_bytes)
        released = False

        def release_both() -> None:
            nonlocal released
            if not released:
                released = True
                slabs.release(lease)
                if out is not None:
                    slabs.release(out)

        ref_arg: Any = None
        if reference is not None:
            try:
                ref_arg = self._reference_slab(reference_version, reference).ref(
                    0, reference.nbytes)
            except ResourceExhausted:
                release_both()
                raise
            self._ref_users[reference_version] = self._ref_users.get(reference_version, 0) + 1
        uses_reference = ref_arg is not None

        def drop_reference() -> None:
            if uses_reference:
                self._drop_reference_user(reference_version)

        def failed() -> None:
            release_both()
            drop_reference()
        job = asyncio.ensure_future(self.backend.run(
            decode_job, self.decoder, header.codec, lease.ref(0, header.payload_bytes), ref_arg,
            out_ref))
        meta = await self._job(job, failed)
        drop_reference()
        self._count(t0)
        return self._rebuild(meta, lease, out, header.payload_bytes), release_both

    async def _job(self, job: asyncio.Future[Any], failed: Callable[[], None]) -> Any:
        """A worker's job for one push, awaited; ``failed`` gives back what the job uses (its
        slabs, a reference version) if it does not succeed: at once, except when the client
        went away (cancelled), where the worker may still be reading or writing them, so
        only once its job has ended."""
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(lambda _: failed())
            raise
        except QueueFull as exc:
            failed()
            raise self._busy(str(exc)) from None
        except BaseException:
            failed()
            raise

    async def _check(self, header: UpdateHeader, lease: Slab, t0: float,
                     checked: DecodedMeta | ServiceError | None = None
                     ) -> tuple[Decoded, Callable[[], None]]:
        """A worker checks the payload (unless a receiver did: ``checked`` is its outcome);
        the update stays in ``lease`` until it is folded."""
        assert self.backend is not None and self.slabs is not None
        slabs = self.slabs
        ref = lease.ref(0, header.payload_bytes)

        def release() -> None:
            slabs.release(lease)
        if checked is None:
            job = asyncio.ensure_future(self.backend.run(check_payload_job, self.decoder,
                                                         header.codec, ref))
            meta = await self._job(job, release)
        elif isinstance(checked, DecodedMeta):
            meta = checked
        else:
            release()
            if isinstance(checked, ServiceError):
                raise checked
            raise TypeError(f"a payload check's outcome is a DecodedMeta or a refusal, got "
                            f"{type(checked).__name__}")
        self._count(t0)
        decoded = Decoded(None, max_abs=meta.max_abs, payload_sha256=meta.payload_sha256,
                          shared=ref, codec=header.codec)
        return decoded, release

    def decode_inline(self, header: UpdateHeader, lease: ReceiveBuffer | Slab,
                      reference: FlatVector | None) -> tuple[Decoded, Callable[[], None]]:
        """:meth:`decode` on the calling thread (``workers = 0``: no backend); synchronous, so
        a caller without an event loop (the simulator, the in-memory transport) runs the
        same decode as the servicer does."""
        if self.backend is not None or not isinstance(lease, ReceiveBuffer):
            raise RuntimeError("an inline decode needs the in-process tier (workers = 0)")
        t0 = time.perf_counter()
        post, buffers, outputs = self.post, self.buffers, self.outputs
        out_lease = self._inline_output(header.codec)
        try:
            decoded = self.decoder.decode(
                header.codec, lease.view, reference=reference,
                out=None if out_lease is None else out_lease.floats(self.decoder.size))
        except BaseException:
            buffers.release(lease)
            if out_lease is not None:
                outputs.release(out_lease)
            raise
        self._count(t0)

        def release() -> None:
            def run() -> None:
                buffers.release(lease)
                if out_lease is not None:
                    outputs.release(out_lease)
            post(run)
        return decoded, release

    def decode_payload(self, header: UpdateHeader, payload: bytes | memoryview,
                       reference: FlatVector | None) -> tuple[Decoded, Callable[[], None]]:
        """Land an in-process caller's payload and decode it on this thread (in-process tier).

        A payload too small for the pooled receive buffers lands in a private writable copy
        (what :meth:`receive` would allocate for it), with nothing to give back afterwards;
        a larger one goes through a pooled buffer, as a network push's does."""
        if len(payload) < self.buffers.min_bytes and self._inline_output(header.codec) is None:
            if self.backend is not None:
                raise RuntimeError("an inline decode needs the in-process tier (workers = 0)")
            t0 = time.perf_counter()
            decoded = self.decoder.decode(header.codec, memoryview(bytearray(payload)),
                                          reference=reference)
            self._count(t0)
            return decoded, _nothing_to_release
        lease = self.receive(len(payload))
        try:
            self.write(lease, 0, memoryview(payload).cast("B"))
        except BaseException:
            self.discard(lease)
            raise
        return self.decode_inline(header, lease, reference)

    def _count(self, t0: float) -> None:
        self.decoded += 1
        self.decode_s += time.perf_counter() - t0

    def _rebuild(self, meta: DecodedMeta, lease: Slab, out: Slab | None,
                 payload_bytes: int) -> Decoded:
        """The decoded arrays as views of the slabs the function wrote (or the payload's)."""
        if meta.exact:
            assert out is not None
            n = self.decoder.size
            hi = np.frombuffer(out.buf, dtype=np.int64, count=n)
            lo = np.frombuffer(out.buf, dtype=np.int64, count=n, offset=8 * n)
            return Decoded(None, weight=meta.weight, count=meta.count, limbs=(hi, lo),
                           max_abs=meta.max_abs, payload_sha256=meta.payload_sha256)
        home = lease if meta.in_place or out is None else out
        source = lease.buf[:payload_bytes] if home is lease else out.buf  # type: ignore[union-attr]
        values = np.frombuffer(source, dtype=np.float32, count=meta.n_values)
        return Decoded(values, weight=meta.weight, count=meta.count, max_abs=meta.max_abs,
                       payload_sha256=meta.payload_sha256,
                       shared=home.ref(0, 4 * meta.n_values))

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

    def tick(self) -> None:
        """Periodic upkeep (the server's tick): receive slabs idle for ``worker_idle_s`` go,
        as idle workers do, so a burst's shared memory and descriptors are given back."""
        if self.slabs is not None:
            self.slabs.trim_idle(self.config.worker_idle_s)

    def stats(self) -> dict[str, Any]:
        """Figures for the metrics row and the log: workers, queue, cold starts, decode time."""
        out: dict[str, Any] = {"decoded": self.decoded,
                               "decode_ms": round(1e3 * self.decode_s / max(self.decoded, 1), 3)}
        if self.backend is not None:
            s = self.backend.stats()
            out.update({"workers": s.get("workers", 0), "queue": s.get("queue_depth", 0),
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


def _nothing_to_release() -> None:
    pass


__all__ = ["RETRY_AFTER_S", "DecodedMeta", "Tier", "check_payload_job", "decode_job",
           "output_nbytes"]
