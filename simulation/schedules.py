"""Local batch schedules: which of its examples each client trains on at each local step.

The schedules are drawn on the host exactly as :class:`~murmura.client.TorchTrainer` (and the
zeroth-order trainer) draw them, client by client, so a client's batches are the same on every
device and on every path; the vectorised executor uploads a chunk's schedule to its device
once, as index, mask and activity tensors (:func:`chunk_schedule`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from murmura.protocols import TaskSettings
from murmura.simulation.execution import Index, Job

__all__ = ["ChunkSchedule", "chunk_schedule", "local_schedule", "schedule_length", "to_device"]


@dataclasses.dataclass
class ChunkSchedule:
    """A chunk's local batches: ``(clients, steps, batch)`` positions drawn on the host as
    each client's trainer draws them, and their device copies."""

    sizes: list[int]                 # each client's number of examples
    valid: npt.NDArray[np.bool_]     # (c, steps, batch): a real row, not padding
    counts: npt.NDArray[np.int64]    # (c, steps): rows in each client's batch
    active: npt.NDArray[np.bool_]    # (c, steps): the client takes this step
    idx: torch.Tensor                # (c, steps, batch) rows of the training data (device)
    mask: torch.Tensor               # (c, steps, batch) float32 validity (device)
    active_t: torch.Tensor           # (c, steps) bool (device)


def local_schedule(n: int, settings: TaskSettings, seed: int) -> npt.NDArray[np.int64]:
    """The batches the trainer would use: a ``(steps, batch_size)`` array of positions into a
    client's ``n`` examples, ``-1`` where a short last batch ends.

    Mirrors :class:`~murmura.client.TorchTrainer`: a generator seeded with ``seed % 2**63``
    draws one ``randperm`` per epoch; batches are consecutive slices of it; ``local_steps``
    (when set) runs across epochs.
    """
    steps = schedule_length(n, settings)
    out = np.empty((steps, settings.batch_size), dtype=np.int64)
    _fill_schedule(out, n, settings, seed, torch.Generator())
    return out


def schedule_length(n: int, settings: TaskSettings) -> int:
    """How many local steps the trainer takes on ``n`` examples."""
    if n <= 0:
        raise ValueError("the local data yielded no batch")
    return settings.local_steps or settings.local_epochs * -(-n // settings.batch_size)


def _fill_schedule(out: npt.NDArray[np.int64], n: int, settings: TaskSettings, seed: int,
                   gen: torch.Generator) -> None:
    """Write :func:`local_schedule` into ``out`` (``(steps, batch_size)``, steps as long as
    the schedule); ``gen`` is reused, reseeded."""
    gen.manual_seed(seed % (2**63))
    b = settings.batch_size
    per_epoch = -(-n // b)
    total = len(out)
    flat = out.reshape(-1)
    flat[:] = -1
    for e in range(-(-total // per_epoch)):
        start = e * per_epoch * b
        room = min(n, len(flat) - start)
        flat[start:start + room] = torch.randperm(n, generator=gen).numpy()[:room]


def chunk_schedule(shares: Sequence[Index], jobs: Sequence[Job], settings: TaskSettings,
                   device: torch.device) -> ChunkSchedule:
    """The batches of a chunk of ``jobs`` (``shares[c]``: client ``c``'s rows of the training
    data), drawn as each client's trainer would draw them, with the index, mask and activity
    tensors on ``device`` (one upload per chunk)."""
    c = len(jobs)
    sizes = [len(shares[j.client]) for j in jobs]
    # a job's own step count (server-assigned) is its local_steps: the same schedule
    lengths = [j.steps or schedule_length(n, settings) for j, n in zip(jobs, sizes,
                                                                      strict=True)]
    steps = max(lengths)
    width = settings.batch_size
    positions = np.full((c, steps, width), -1, dtype=np.int64)
    gen = torch.Generator()
    if settings.local_steps or all(j.steps for j in jobs):
        for i, (n, length, job) in enumerate(zip(sizes, lengths, jobs, strict=True)):
            _fill_schedule(positions[i, :length], n, settings, job.seed, gen)
    else:  # whole epochs: each epoch is one permutation, padded to whole batches
        epochs = settings.local_epochs
        for i, (n, length, job) in enumerate(zip(sizes, lengths, jobs, strict=True)):
            gen.manual_seed(job.seed % (2**63))
            view = positions[i, :length].reshape(epochs, -1)
            for e in range(epochs):
                view[e, :n] = torch.randperm(n, generator=gen).numpy()
    valid = positions >= 0
    safe = np.where(valid, positions, 0)
    if all(n == sizes[0] for n in sizes):  # one shape: gather every client at once
        stacked = np.stack([shares[j.client] for j in jobs])     # (c, n)
        idx = np.take_along_axis(stacked, safe.reshape(c, -1), axis=1).reshape(safe.shape)
    else:
        idx = np.empty_like(safe)
        for i, job in enumerate(jobs):
            idx[i] = shares[job.client][safe[i]]
    idx[~valid] = 0
    counts = valid.sum(axis=2)                                   # (c, steps)
    active = counts > 0
    # the schedule goes to the device once per chunk; no step below waits for the host
    return ChunkSchedule(sizes, valid, counts, active,
                         to_device(torch.from_numpy(idx), device),
                         to_device(torch.from_numpy(valid.astype(np.float32)), device),
                         to_device(torch.from_numpy(active), device))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (itself on the CPU; an asynchronous copy to a CUDA device)."""
    return t if device.type == "cpu" else t.to(device, non_blocking=device.type == "cuda")
