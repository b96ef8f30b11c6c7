"""Durable global-model checkpoints, written atomically.

A checkpoint is one ``.npz`` file: the global vector, the server optimizer's state and a JSON
header (version, spec fingerprint, counters). It is written to a temporary file in the same
directory, flushed to disk, then renamed over the old one, so a crash leaves either the old or
the new checkpoint, never a torn file.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from murmura.protocols import FlatVector

FORMAT = 1


@dataclass
class Checkpoint:
    version: int
    params: FlatVector
    spec_fingerprint: str
    optimizer_state: dict[str, FlatVector] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    #: Further named arrays kept with their own dtype (e.g. a seed pool's float64 sums).
    extra: dict[str, np.ndarray] = field(default_factory=dict)


def save_checkpoint(path: str | Path, ckpt: Checkpoint) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"format": FORMAT, "version": ckpt.version,
              "spec_fingerprint": ckpt.spec_fingerprint, "meta": ckpt.meta}
    arrays = {"params": ckpt.params}
    arrays.update({f"opt.{k}": v for k, v in ckpt.optimizer_state.items()})
    arrays.update({f"x.{k}": v for k, v in ckpt.extra.items()})
    buf = io.BytesIO()
    np.savez(buf, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), **arrays)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(bytes(z["header"]).decode())
            params = np.asarray(z["params"], dtype=np.float32)
            opt = {k[4:]: np.asarray(z[k], dtype=np.float32) for k in z.files
                   if k.startswith("opt.")}
            extra = {k[2:]: np.asarray(z[k]) for k in z.files if k.startswith("x.")}
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        # a truncated or corrupted file lands here too (zip errors, short reads)
        raise ValueError(f"{path} is not a readable Murmura checkpoint: {exc}") from exc
    if header.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {header.get('format')} is not {FORMAT}")
    return Checkpoint(version=int(header["version"]), params=params,
                      spec_fingerprint=str(header["spec_fingerprint"]),
                      optimizer_state=opt, meta=dict(header.get("meta", {})), extra=extra)
