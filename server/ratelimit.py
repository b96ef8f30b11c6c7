"""Per-identity token buckets: how often one client may Join or Push.

An honest client joins once per process start and pushes once per task, so a bucket that refills
at a few requests per second with a modest burst never touches it, while one identity flooding
the gateway is refused with RESOURCE_EXHAUSTED and a retry hint instead of taking the server's
time from everyone else. Buckets live in a bounded LRU map, so a flood of made-up identities
costs bounded memory.
"""

from __future__ import annotations

from collections import OrderedDict


class RateLimiter:
    """``allow(key, now)`` spends one token of ``key``'s bucket, or says how long to wait.

    Each bucket holds at most ``burst`` tokens and regains ``rate`` tokens per second. A rate of
    0 turns the limiter off. ``now`` is passed in so the simulator's virtual clock drives it.
    """

    def __init__(self, rate: float, burst: float, *, max_keys: int = 100_000) -> None:
        if rate < 0 or burst < 1:
            raise ValueError(f"rate must be >= 0 and burst >= 1, got {rate} and {burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, key: str, now: float) -> float:
        """0.0 when the request may go ahead (a token was spent), else seconds to wait."""
        if self.rate == 0:
            return 0.0
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens, now)
        if len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)  # the least recently seen identity
        return wait

    def __len__(self) -> int:
        return len(self._buckets)


__all__ = ["RateLimiter"]
