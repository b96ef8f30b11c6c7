"""Where a client's array data lives while :class:`~murmura.client.torch_trainer.TorchTrainer`
trains on an accelerator: on the host, copied to the device once, or gathered per batch into
page-locked (or plain) host memory.

The decision is a pure function of sizes (:func:`data_placement`), kept apart from the trainer
so it can be tested and reasoned about without a device, and so the trainer's module holds
the training itself; :class:`_PlacedData` is the data set as a trainer holds it once placed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from murmura.tasks import ArrayDataset

#: Share of the device's free memory a client's array data may take there: twice its size (the
#: arrays and the epoch's shuffled copy) must fit in it. The rest is left to the model, its
#: optimizer state and activations, and to the other clients sharing the device (``murmura
#: launch`` starts several per GPU; each sizes its data against what is free when it starts).
RESIDENT_FRACTION = 0.25


def data_placement(data_bytes: int, device_type: str, free_bytes: int, *,
                   fraction: float = RESIDENT_FRACTION) -> str:
    """Where a client's array data lives while it trains on a ``device_type`` device.

    ``"host"`` on the CPU: the arrays are used where they are. ``"device"`` when twice
    ``data_bytes`` (the arrays and one shuffled copy per epoch) fits in ``fraction`` of the
    ``free_bytes`` the device has: copied there once, shuffled and sliced there. Otherwise
    each batch is gathered on the host and copied over: into page-locked memory with a
    non-blocking copy on CUDA (``"pinned"``), a plain copy elsewhere (``"pageable"``).
    """
    if data_bytes < 0 or free_bytes < 0 or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"need data_bytes >= 0, free_bytes >= 0 and 0 <= fraction <= 1, got "
                         f"{data_bytes}, {free_bytes}, {fraction}")
    if device_type == "cpu":
        return "host"
    if 2 * data_bytes <= fraction * free_bytes:
        return "device"
    return "pinned" if device_type == "cuda" else "pageable"


def _torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


@dataclass
class _PlacedData:
    """An :class:`ArrayDataset` as one trainer holds it on its device (see
    :func:`data_placement`); ``x``/``y`` are device copies under ``"device"``, else None."""

    source: ArrayDataset
    x_array: np.ndarray[Any, Any]
    y_array: np.ndarray[Any, Any]
    mode: str
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None

    def holds(self, source: ArrayDataset) -> bool:
        return (self.source is source and self.x_array is source.x
                and self.y_array is source.y)
