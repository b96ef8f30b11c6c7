"""One push pipeline: the steps every update takes, whoever delivers it.

An update goes through the same steps whether it came over gRPC, through the in-memory
transport, from the simulator's virtual clients, a test or a benchmark:

1. **precheck** — checks that need only the header (session, size limit, signature present,
   model fingerprint), so a transport refuses before it receives a payload;
2. **land** — the payload bytes go into the tier's buffer (a reused receive buffer, or a
   shared-memory slab that worker processes map);
3. **begin** — the checks that need the payload's length, rate limits, and duplicates (a
   retried update already counted is answered without decoding it);
4. **spool and decode** — with durable state the payload is appended to the spool while it is
   decoded and checked, inline or by an aggregation function in a worker (the tier);
5. **finish** — staleness, the aggregate's bound, the durable record, and the policy's fold
   (on the publisher, which may publish a version);
6. **answer** — once the update is durable (and, over gRPC, once the version it completed is
   out, so the reply names it).

:meth:`PushPipeline.push` runs them on the caller's thread with the in-process tier
(``workers = 0``): the simulator, the in-memory transport, tests and benchmarks. Its payload is
all there already, so it lands it after *begin* (a duplicate is then never copied). The gRPC
servicer receives the stream itself (step 2 happens as chunks arrive) and then awaits
:meth:`PushPipeline.complete`, the same steps with the decode awaited on the tier's
backend. Nothing else calls the core's push steps (``begin_push``, ``finish_push``,
``abort_push``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from murmura.protocols import PushResult, UpdateHeader
from murmura.server.buffers import ReceiveBuffer
from murmura.server.errors import InvalidArgument, Unavailable
from murmura.server.futures import wait_for_thread
from murmura.server.slabs import Slab
from murmura.server.state import SpoolRef
from murmura.server.tier import Tier

if TYPE_CHECKING:
    from murmura.server.core import AggregatorCore

__all__ = ["PushPipeline"]


class PushPipeline:
    """The steps of a push (see the module docstring) over one core and one tier."""

    def __init__(self, core: AggregatorCore, tier: Tier) -> None:
        self.core = core
        self.tier = tier

    # -- steps 1 and 2: the transport's part -----------------------------------------------

    def precheck(self, header: UpdateHeader) -> None:
        self.core.precheck(header)

    def receive(self, nbytes: int) -> ReceiveBuffer | Slab:
        """Where the payload lands (refused with a retry hint when memory is exhausted)."""
        return self.tier.receive(nbytes)

    # -- the synchronous driver --------------------------------------------------------------

    def push(self, header: UpdateHeader, payload: bytes | memoryview, *,
             wire_bytes: int = 0) -> PushResult:
        """Every step on this thread (the in-process tier); refusals raise ServiceError."""
        core, tier = self.core, self.tier
        rec = core.precheck(header)
        if len(payload) != header.payload_bytes:
            exc = InvalidArgument(f"header announced {header.payload_bytes} payload bytes, "
                                  f"the push carried {len(payload)}")
            core.count_refusal(exc)
            raise exc
        core.last_durable = None
        rec, duplicate = core.begin_push(header, len(payload), wire_bytes=wire_bytes,
                                         prechecked=rec)
        if duplicate is not None:
            _wait(core.last_durable, "the update")
            return duplicate
        state = core.store
        spooling = state.spool(payload) if state is not None else None
        try:  # landed in the tier's buffer and decoded there, as a network push is
            decoded, release = tier.decode_payload(header, payload, core.reference_for(header))
        except BaseException as exc:
            core.abort_push(header, exc)
            raise
        spooled = None if spooling is None else self._spooled(header, spooling, release)
        # nothing ran since begin_push on this thread: the client's record is the one it found
        result = core.finish_push(header, decoded, release=release, spooled=spooled, rec=rec)
        del decoded, release  # the fold releases the buffers once nothing holds them
        if core.last_durable is not None:
            _wait(core.last_durable, "the update")
        return result

    # -- the asynchronous driver (the gRPC servicer) ---------------------------------------

    async def complete(self, header: UpdateHeader, lease: ReceiveBuffer | Slab, received: int,
                       wire_bytes: int, *, cancelled: Callable[[], bool],
                       at: Callable[[str], None] = lambda step: None,
                       checked: Any = None) -> PushResult:
        """Steps 3 to 6 for a payload the transport landed in ``lease`` (which belongs to the
        pipeline from here on). ``cancelled`` says whether the client went away: before the
        update is taken it then does not count; ``at`` marks each step (tests); ``checked``
        is a receiver's check of the payload (:meth:`Tier.decode`)."""
        core, tier = self.core, self.tier
        try:
            duplicate = self._begin(header, received, wire_bytes)
        except BaseException:
            tier.discard(lease)
            raise
        if duplicate is not None:
            tier.discard(lease)
            at("push.duplicate")
            await _await(core.last_durable, "the update")
            return duplicate
        spooling = self._spool(lease, received)
        try:
            at("push.decode")
            decoded, release = await tier.decode(header, lease, core.reference_for(header),
                                                 header.base_version, checked=checked)
        except BaseException as exc:
            core.abort_push(header, exc)
            raise
        spooled: SpoolRef | None = None
        if spooling is not None:
            try:  # the buffer must outlive the spool write: the fold may release it
                at("push.spool")
                spooled = await wait_for_thread(spooling)
            except BaseException as exc:  # disk full or failing, or the client went away
                release()
                if not isinstance(exc, Exception):  # cancelled: forget the update
                    core.abort_push(header, exc)
                    raise
                err = Unavailable(f"the update could not be spooled: {exc}"[:200])
                core.abort_push(header, err)
                raise err from None
        if cancelled():  # the client gave up: it must not count (it may retry)
            release()
            core.abort_push(header, asyncio.CancelledError())
            raise asyncio.CancelledError()
        publishes = core.publishes
        result = core.finish_push(header, decoded, release=release, spooled=spooled)
        del decoded, release
        # Acknowledged only once durable (a group commit on the store thread). From here on
        # the update is taken: a cancelled call leaves it to be committed and applied, and
        # the client's retry is answered as a duplicate.
        at("push.durable")
        await _await(core.last_durable, "the update")
        if core.publishes != publishes and core.last_publish is not None:
            # This update completed a version: answer once it is out (the loop stays free
            # meanwhile), so the reply names the version that includes it.
            try:
                at("push.publish")
                await wait_for_thread(core.last_publish)
            except Exception:  # noqa: BLE001 - logged by the core; the update was taken
                pass
            at("push.install")
            await asyncio.sleep(0)  # let the install scheduled before us run
            result = dataclasses.replace(result, version=core.version)
        return result

    # -- shared steps --------------------------------------------------------------------------

    def _begin(self, header: UpdateHeader, received: int, wire_bytes: int
               ) -> PushResult | None:
        self.core.last_durable = None
        _, duplicate = self.core.begin_push(header, received, wire_bytes=wire_bytes)
        return duplicate

    def _spool(self, lease: ReceiveBuffer | Slab, received: int) -> Future[SpoolRef] | None:
        """With durable state, the payload starts going to the spool (store thread) while it
        is decoded."""
        state = self.core.store
        if state is None:
            return None
        return state.spool(lease.view if isinstance(lease, ReceiveBuffer)
                           else lease.buf[:received])

    def _spooled(self, header: UpdateHeader, spooling: Future[SpoolRef],
                 release: Callable[[], None]) -> SpoolRef:
        """The synchronous driver's wait for the spool write; a failure refuses the update
        (UNAVAILABLE, retryable) and gives its buffers back."""
        try:
            return spooling.result()
        except Exception as exc:  # noqa: BLE001 - disk full or failing: refused, retryable
            release()
            err = Unavailable(f"the update could not be spooled: {exc}"[:200])
            self.core.abort_push(header, err)
            raise err from None


def _wait(fut: Future[Any] | None, what: str) -> None:
    """Block until a durable operation is kept; UNAVAILABLE if it failed."""
    if fut is None:
        return
    try:
        fut.result()
    except Exception as exc:  # noqa: BLE001 - the state logged it
        raise Unavailable(f"{what} could not be made durable; retry later") from exc


async def _await(fut: Future[Any] | None, what: str) -> None:
    """Wait (off the loop) until a durable operation is kept; UNAVAILABLE if it failed. A
    cancelled wait leaves the operation to finish (see server/futures.py)."""
    if fut is None:
        return
    try:
        await wait_for_thread(fut)
    except Exception as exc:  # noqa: BLE001 - the state logged it
        raise Unavailable(f"{what} could not be made durable; retry later") from exc

