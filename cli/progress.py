"""A one-line progress bar for long runs (stderr); plain lines when not on a terminal."""

from __future__ import annotations

import sys
from typing import Any, TextIO


class Progress:
    def __init__(self, total: int, *, stream: TextIO | None = None, width: int = 24) -> None:
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self._last = -1

    def update(self, row: dict[str, Any]) -> None:
        version = int(row.get("version", 0))
        if version == self._last:
            return
        self._last = version
        filled = int(self.width * min(version, self.total) / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        acc = row.get("accuracy")
        text = (f"[{bar}] version {version}/{self.total}"
                + (f"  round {row['round']}" if row.get("round") else "")
                + (f"  acc {acc:.3f}" if isinstance(acc, float) else "")
                + f"  updates {row.get('updates', 0)}"
                + f"  up {row.get('bytes_up', 0) / 1e6:.2f} MB"
                + f"  {row.get('time_s', 0.0):.1f}s")
        if self.tty:
            self.stream.write("\r" + text.ljust(100))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._last >= 0:
            self.stream.write("\n")
            self.stream.flush()
