"""Futures shared between the event loop and the server's threads, made safe to abandon.

A request handler waits on futures that the store, spool and publisher threads complete. When
the client cancels or its deadline passes, gRPC cancels the handler; if the handler's wait
cancelled the thread's future too, the thread would later fail to complete it
(``InvalidStateError``) and die, and every later request waiting on that thread would hang.
Two rules prevent it, each enough on its own:

* handlers wait through :func:`wait_for_thread`, which shields the thread's future, so a
  cancelled handler stops waiting and the work still finishes (and still counts);
* threads complete futures through :func:`settle`, which leaves a future that is already done
  (cancelled by anyone) alone instead of raising.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["settle", "wait_for_thread"]


def settle(fut: concurrent.futures.Future[Any] | asyncio.Future[Any], *, result: Any = None,
           exc: BaseException | None = None) -> bool:
    """Complete ``fut`` with ``result`` or ``exc``; False (and nothing raised) when it was done
    already, e.g. cancelled by a waiter that went away."""
    if fut.done():
        return False
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except (concurrent.futures.InvalidStateError, asyncio.InvalidStateError):
        return False  # cancelled between the check and the call
    return True


async def wait_for_thread(fut: concurrent.futures.Future[T]) -> T:
    """Wait on the loop for a thread's future without ever cancelling it.

    If the waiting task is cancelled, CancelledError reaches it at once and the thread's work
    goes on; its outcome is still consumed, so a failure is not reported as never retrieved.
    """
    inner = asyncio.wrap_future(fut)
    try:
        return await asyncio.shield(inner)
    except asyncio.CancelledError:
        inner.add_done_callback(_consume)
        raise


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
