"""``murmura launch``: N client processes per device, kept alive, with one status table.

Each client is an ordinary ``murmura client`` process (its own CUDA context and memory cap,
so one crashing client takes nothing else down). The launcher restarts a client that exits
with an error after an exponential backoff, leaves alone one that finished (the server said
stop), and reads each client's status file (``murmura client --status-file``, written by
:class:`murmura.client.StatusTrainer` after every task: the version it trained on,
examples/s) to draw the table.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from murmura.protocols.identity import NodeKey

log = logging.getLogger(__name__)

#: How much of the stderr of a crashed client the table shows.
ERROR_CHARS = 60


def detect_devices(spec: str = "auto") -> list[str]:
    """The devices to launch on: ``auto`` is every CUDA GPU, else Apple MPS, else the CPU;
    otherwise a comma-separated list (``cuda:0,cuda:1,cpu``), each checked."""
    if spec == "auto":
        if torch.cuda.is_available():
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        if hasattr(torch.backends, "mps") and torch.backends.mps.is_available():
            return ["mps"]
        return ["cpu"]
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if not devices:
        raise ValueError("devices must be 'auto' or a list such as cuda:0,cuda:1,cpu")
    for d in devices:
        if d == "cpu":
            continue
        if d == "mps":
            if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
                raise ValueError("device 'mps' was asked for but MPS is not available")
            continue
        if d.startswith("cuda"):
            index = d.partition(":")[2] or "0"
            if not index.isdigit():
                raise ValueError(f"device {d[:20]!r}: expected cuda:N")
            if not torch.cuda.is_available() or int(index) >= torch.cuda.device_count():
                raise ValueError(f"device {d[:20]!r} was asked for but is not available")
            continue
        raise ValueError(f"unknown device {d[:20]!r}; use auto, cpu, mps or cuda:N")
    return devices


@dataclass(frozen=True)
class Backoff:
    """Restart delays: ``initial_s`` doubling up to ``max_s``; a client that ran for
    ``reset_after_s`` starts again from ``initial_s``."""

    initial_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def delay(self, failures: int) -> float:
        return min(self.initial_s * 2.0 ** max(failures - 1, 0), self.max_s)


@dataclass
class Slot:
    """One client the launcher keeps running."""

    index: int
    device: str
    argv: list[str]
    status_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restarts: int = 0
    failures: int = 0
    next_start: float = 0.0
    finished: bool = False
    last_error: str = ""
    stderr_path: Path | None = None
    _log: Any = field(default=None, repr=False)

    @property
    def client_id(self) -> str:
        """The slot's name in the status table (the server knows the client by its key's id,
        which the client logs at start)."""
        return f"launch-{self.index:03d}"

    def status(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.status_path.read_text()))
        except (OSError, ValueError):
            return {}


class Launcher:
    """Starts ``clients_per_device`` clients on each device and keeps them running.

    Client ``k`` (counting over devices) holds data share ``client_index_start + k`` of
    ``num_clients`` and is called ``launch-<share>``. ``client_args`` go to every
    ``murmura client`` command line (e.g. ``--token``, ``--task``).
    """

    def __init__(self, server: str, devices: Sequence[str], *, clients_per_device: int = 1,
                 memory_fraction: float = 0.0, client_index_start: int = 0,
                 num_clients: int = 0, client_args: Sequence[str] = (),
                 work_dir: str | Path, backoff: Backoff | None = None,
                 python: str = sys.executable,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if clients_per_device < 1:
            raise ValueError(f"clients_per_device must be >= 1, got {clients_per_device}")
        if not 0 <= memory_fraction <= 1:
            raise ValueError(f"memory_fraction must lie in [0, 1] (0: no cap), got "
                             f"{memory_fraction}")
        total = clients_per_device * len(devices)
        num_clients = num_clients or client_index_start + total
        if client_index_start < 0 or client_index_start + total > num_clients:
            raise ValueError(f"shares {client_index_start}..{client_index_start + total - 1} "
                             f"do not fit in num_clients={num_clients}")
        self.backoff = backoff or Backoff()
        self.clock = clock
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.slots: list[Slot] = []
        for d_i, device in enumerate(devices):
            for j in range(clients_per_device):
                k = client_index_start + d_i * clients_per_device + j
                status = self.work_dir / f"client-{k:03d}.json"
                argv = [python, "-m", "murmura", "client", "--server", server,
                        "--device", device, "--client-index", str(k),
                        "--num-clients", str(num_clients),
                        "--key", str(self._key_file(k)),
                        "--status-file", str(status), *client_args]
                if memory_fraction and device.startswith("cuda"):
                    argv += ["--memory-fraction", str(memory_fraction)]
                self.slots.append(Slot(k, device, argv, status))
        self._stop = threading.Event()

    def _key_file(self, share: int) -> Path:
        """The client's identity key, made once and kept in the work dir: a restarted client
        proves the same key, so it takes its own session back (docs/security.md)."""
        path = self.work_dir / f"launch-{share:03d}.key"
        if not path.exists():
            NodeKey.generate().save(path)
        return path

    def _start(self, slot: Slot) -> None:
        slot.stderr_path = self.work_dir / f"client-{slot.index:03d}.log"
        slot._log = open(slot.stderr_path, "wb")  # noqa: SIM115 - closed in _reap
        slot.proc = subprocess.Popen(slot.argv, stdout=slot._log, stderr=subprocess.STDOUT)
        slot.started = self.clock()
        log.info("started %s on %s (pid %d)", slot.client_id, slot.device, slot.proc.pid)

    def _reap(self, slot: Slot) -> None:
        assert slot.proc is not None
        code = slot.proc.returncode
        slot._log.close()
        slot.proc = None
        now = self.clock()
        if code == 0:
            slot.finished = True
            return
        if now - slot.started >= self.backoff.reset_after_s:
            slot.failures = 0
        slot.failures += 1
        slot.last_error = f"exit {code}: {_tail(slot.stderr_path)}"[:ERROR_CHARS]
        slot.next_start = now + self.backoff.delay(slot.failures)
        log.warning("%s exited with %s; restarting in %.1fs", slot.client_id, code,
                    slot.next_start - now)

    def poll(self) -> None:
        """One pass: reap exited clients, start the ones due."""
        now = self.clock()
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is not None:
                self._reap(slot)
            if slot.proc is None and not slot.finished and now >= slot.next_start \
                    and not self._stop.is_set():
                if slot.started:
                    slot.restarts += 1
                self._start(slot)

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.slots)

    def run(self, *, interval_s: float = 0.5, out: TextIO | None = None,
            table_every_s: float = 2.0) -> int:
        """Keep the clients running until all finish or :meth:`stop`; 0 when all finished."""
        last_table = -1e9
        try:
            while not self._stop.is_set() and not self.done:
                self.poll()
                if out is not None and self.clock() - last_table >= table_every_s:
                    last_table = self.clock()
                    out.write(self.table() + "\n")
                    out.flush()
                self._stop.wait(interval_s)
        finally:
            self.shutdown()
        if out is not None:
            out.write(self.table() + "\n" + self.summary() + "\n")
            out.flush()
        return 0 if self.done else 1

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every client (SIGTERM, then SIGKILL after ``timeout_s``)."""
        self._stop.set()
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.terminate()
        for slot in self.slots:
            if slot.proc is not None:
                try:
                    slot.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    slot.proc.kill()
                    slot.proc.wait()
                slot._log.close()
                slot.proc = None

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for s in self.slots:
            st = s.status()
            # a live client that has not pulled a model yet is loading data or joining
            state = ("done" if s.finished else "restarting" if s.proc is None
                     else "running" if st else "starting")
            out.append({"client": s.client_id, "device": s.device, "state": state,
                        "pid": s.proc.pid if s.proc is not None else None,
                        "version": st.get("version"), "tasks": st.get("tasks", 0),
                        "examples_per_s": st.get("examples_per_s"), "restarts": s.restarts,
                        "last_error": s.last_error})
        return out

    def summary(self) -> str:
        """The closing line: clients done, tasks finished, the last global version (what
        a finished client was told at its stop: the run's last), restarts."""
        rows = self.rows()
        versions = [r["version"] for r in rows if r["version"] is not None]
        done = sum(r["state"] == "done" for r in rows)
        return (f"murmura launch: {done}/{len(rows)} clients done, "
                f"{sum(r['tasks'] for r in rows)} tasks, "
                f"last version {max(versions) if versions else '-'}, "
                f"{sum(r['restarts'] for r in rows)} restarts")

    def table(self) -> str:
        """The status table: client, device, state, version, tasks, examples/s, restarts,
        last error."""
        head = (f"{'client':<11} {'device':<8} {'state':<10} {'version':>7} {'tasks':>5} "
                f"{'ex/s':>9} {'restarts':>8}  last error")
        lines = [head]
        for r in self.rows():
            version = "-" if r["version"] is None else str(r["version"])
            speed = "-" if r["examples_per_s"] is None else f"{r['examples_per_s']:.1f}"
            lines.append(f"{r['client']:<11} {r['device']:<8} {r['state']:<10} {version:>7} "
                         f"{r['tasks']:>5} {speed:>9} {r['restarts']:>8}  {r['last_error']}")
        return "\n".join(lines)


def _tail(path: Path | None) -> str:
    if path is None:
        return ""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip() if lines else "no output"


__all__ = ["Backoff", "Launcher", "Slot", "detect_devices"]
