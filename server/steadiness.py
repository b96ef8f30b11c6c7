"""Noticing a run whose accuracy swings from version to version, and saying what steadies it.

A user who watches only the final figure of an async run cannot tell a model that converged
from one that jumps between 0.9 and 0.4 every few versions and happened to stop high. The
aggregator measures every version, so it can tell: :class:`SwingWatch` sees each version's
accuracy and, once the accuracy has fallen sharply from one version to the next more than once
within a window, returns one warning naming the drops and the settings that set the size of
the server's step. It warns once per run: the metrics rows carry the figures from then on.
"""

from __future__ import annotations

from collections import deque

#: A fall of at least this much accuracy from one version to the next counts as a swing.
SWING_DROP = 0.15
#: Swings within this many versions that make a run unsteady.
SWING_WINDOW = 10
SWING_COUNT = 2


class SwingWatch:
    """Counts sharp version-to-version drops of accuracy over a sliding window of versions."""

    def __init__(self, *, drop: float = SWING_DROP, window: int = SWING_WINDOW,
                 count: int = SWING_COUNT) -> None:
        if not 0 < drop < 1:
            raise ValueError(f"drop must lie in (0, 1), got {drop}")
        if window < 2 or count < 1:
            raise ValueError(f"need window >= 2 and count >= 1, got {window} and {count}")
        self.drop, self.window, self.count = drop, window, count
        self._last: float | None = None
        self._drops: deque[tuple[int, float, float]] = deque()  # (version, before, after)
        self.warned = False

    def see(self, version: int, accuracy: float | None) -> list[tuple[int, float, float]]:
        """Take version ``version``'s accuracy (None: not measured). Returns the drops that make
        the run unsteady the first time there are enough of them, else an empty list."""
        if accuracy is None or accuracy != accuracy:  # unmeasured or NaN: no comparison
            return []
        before, self._last = self._last, accuracy
        if before is not None and before - accuracy >= self.drop:
            self._drops.append((version, before, accuracy))
        while self._drops and self._drops[0][0] <= version - self.window:
            self._drops.popleft()
        if self.warned or len(self._drops) < self.count:
            return []
        self.warned = True
        return list(self._drops)


def swing_advice(drops: list[tuple[int, float, float]], *, mode: str, buffer_size: int,
                 clients: int, server_lr: float) -> str:
    """The warning for ``drops``: what happened and which settings size the server's step."""
    what = ", ".join(f"{b:.2f} -> {a:.2f} at version {v}" for v, b, a in drops)
    text = f"accuracy swings between versions ({what})"
    if mode == "async" and 0 < buffer_size < clients:
        share = buffer_size / clients
        text += (f"; each async version steps with {buffer_size} of the {clients} clients' "
                 f"updates, so the model takes about {1 / share:.1g} server steps per round of "
                 f"client work; a --buffer-size near {clients} or a --server-lr near "
                 f"{server_lr * share:.2g} steadies it")
    else:
        text += (f"; the server's step may be too large for these clients' updates: a smaller "
                 f"--server-lr (now {server_lr:g}) or client --lr steadies it")
    return text


__all__ = ["SWING_COUNT", "SWING_DROP", "SWING_WINDOW", "SwingWatch", "swing_advice"]
