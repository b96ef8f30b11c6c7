"""When to send a refused request again, and when to stop: the one backoff every loop uses.

Four loops retry: :class:`~murmura.client.ClientRuntime` (a deployed client), the gossip
peer's join and its model sends, and the simulator's virtual clients. They differ in how they
wait (``time.sleep``, a stop event, an event scheduled in virtual time) but not in how long:
:class:`RetryPolicy` computes the pauses, so the simulator backs off exactly as a deployed
client does, jitter and the server's retry hint included. It holds no clock and never sleeps:
the caller passes ``now`` in and waits the returned pause its own way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Backoff", "RetryPolicy", "jitter_rng"]


def jitter_rng(client_id: str) -> random.Random:
    """The random stream of a client's backoff jitter, seeded by its id alone.

    A function of the id (like the encoder's seed): a simulated client draws the pauses the
    deployed client of that id would, and a rerun of a simulation draws them again.
    """
    return random.Random(client_id)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, honouring the server's retry hint, with a deadline.

    The n-th pause is ``min(initial_s * multiplier**n, max_s)`` scaled by a uniform factor in
    ``[1 - jitter, 1 + jitter]`` (so clients refused together do not come back together),
    and never shorter than the server's ``retry_after_s`` (it knows when it will have room).
    No try is made later than ``give_up_after_s`` after the start: the last pause is cut to
    end at that deadline, and a pause the server wants longer than that means giving up.
    """

    initial_s: float = 0.2
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2
    give_up_after_s: float = 300.0

    def __post_init__(self) -> None:
        if not (0 < self.initial_s <= self.max_s and self.multiplier >= 1 and 0 <= self.jitter < 1
                and self.give_up_after_s >= 0):
            raise ValueError("retry policy needs 0 < initial_s <= max_s, multiplier >= 1, "
                             "0 <= jitter < 1 and give_up_after_s >= 0")

    def start(self, now: float, rng: random.Random | None = None) -> Backoff:
        """The backoff of one request first tried at ``now`` (the deadline counts from it).

        ``rng`` draws the jitter: pass a seeded one (:func:`jitter_rng`) for pauses that a
        rerun repeats; by default a fresh one seeded by the operating system.
        """
        return Backoff(self, now, random.Random() if rng is None else rng)


class Backoff:
    """The pauses of one request's retries, from :meth:`RetryPolicy.start`."""

    def __init__(self, policy: RetryPolicy, started: float, rng: random.Random) -> None:
        self.policy = policy
        self.started = started
        #: No try after this time (same clock as ``now``).
        self.deadline = started + policy.give_up_after_s
        #: Pauses handed out so far (retries made, when each is followed by a try).
        self.attempts = 0
        self._delay = policy.initial_s
        self._rng = rng
        self._last = False  # the previous pause was cut to end at the deadline

    def next_pause(self, now: float, retry_after_s: float | None = None) -> float | None:
        """Seconds to wait before the next try, after a retryable failure at ``now``; None:
        give up (the deadline has passed, or the server's ``retry_after_s`` ends after it)."""
        left = self.deadline - now
        if self._last or left <= 0:
            return None
        p = self.policy
        pause = self._delay * (1 + p.jitter * (2 * self._rng.random() - 1))
        if retry_after_s is not None:  # the server is busy: back off as long as it asks
            if retry_after_s > left:
                return None
            pause = max(pause, retry_after_s)
        if pause >= left:  # one last try, at the deadline
            pause, self._last = left, True
        self._delay = min(self._delay * p.multiplier, p.max_s)
        self.attempts += 1
        return pause
