"""Where the vectorised executor's memory goes: how many clients a chunk holds on a device,
the host blocks trained chunks are read back into, and the one-time upload of the data.

Split from :mod:`.vectorised`, whose executor mixes :class:`ChunkSizing` in: the step
arithmetic lives there, the device and host memory bookkeeping here.
"""

from __future__ import annotations

import copy
import logging
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from murmura.protocols import TaskSettings
from murmura.simulation.config import resolve_device

log = logging.getLogger(__name__)

#: ``chunk_size=0`` on CUDA: the share of the free device memory the chunk may fill (the rest
#: is the allocator's slack, the estimate's error and whatever else runs on the device).
AUTO_MEMORY_FRACTION = 0.5
#: ``chunk_size=0`` on CUDA: never more clients per chunk than this (larger chunks only make
#: the host-side schedule arrays bigger; a GPU is busy long before).
MAX_AUTO_CHUNK = 1 << 16
#: Read-back blocks kept in pinned (page-locked) host memory, in bytes, and blocks kept at all.
MAX_PINNED_BYTES = 8 << 30
MAX_HOST_BLOCKS = 256


class ChunkSizing:
    """The executor's chunk size: the one asked for, or sized from the free device memory
    and one client's footprint (mixed into
    :class:`~murmura.simulation.vectorised.VectorisedExecutor`)."""

    #: clients per chunk (0 until auto has sized them), and what was asked for (0: auto)
    chunk_size: int
    requested_chunk: int

    if TYPE_CHECKING:  # the executor's state, typed where VectorisedExecutor declares it
        def __getattr__(self, name: str) -> Any: ...


    def chunk_for(self, settings: TaskSettings) -> int:
        """Clients per vmapped batch for ``settings``: the one asked for, or (auto) the size
        that fits this device at this batch size (1024 off CUDA)."""
        if self.requested_chunk or self.device.type != "cuda":
            return self.chunk_size
        size = self._auto_chunks.get(settings.batch_size)
        if size is None:
            per = self.client_footprint(settings.batch_size)
            free, _ = torch.cuda.mem_get_info(self.device)
            # plus what torch's caching allocator holds unused (free to it, not to the driver)
            free += (torch.cuda.memory_reserved(self.device)
                     - torch.cuda.memory_allocated(self.device))
            size = max(1, min(MAX_AUTO_CHUNK, int(free * self.memory_fraction) // per))
            self._auto_chunks[settings.batch_size] = size
            self.sizing = self._sized = (f": {free / 2**30:.1f} GiB free x "
                                         f"{self.memory_fraction:g} / {per / 2**20:.2f} MiB "
                                         f"per client")
            log.info("vmap on %s: %d clients per chunk%s", self.device_name, size,
                     self.sizing)
        self.chunk_size = size
        return size

    def client_footprint(self, batch_size: int) -> int:
        """Bytes one client of a chunk holds on the device during a step (an estimate).

        Its parameters and buffers twice (before and after a step), its gradients, momentum
        and the update's temporaries (three times the trainable parameters), its batch
        (rows, indices, mask), its row of the result block, and twice the activations one
        batch saves for the backward pass (measured once with a forward pass of the template
        on ``batch_size`` rows, counting the tensors autograd saves; twice: vmap's and the
        backward pass's temporaries).
        """
        state = sum(v.numel() * v.element_size()
                    for v in self.model.state_dict(keep_vars=True).values())
        trainable = sum(p.numel() * p.element_size()
                        for n, p in self.model.named_parameters() if n in self.trainable)
        row = (self._x[0].numel() * self._x.element_size()
               + self._y[0].numel() * self._y.element_size())
        batch = batch_size * (row + 8 + 4)  # rows, int64 index, float32 mask
        return (2 * state + 3 * trainable + batch + 4 * self.spec.size
                + 2 * self._activation_bytes(batch_size))

    def _activation_bytes(self, batch_size: int) -> int:
        """Bytes autograd saves for one client's backward pass on ``batch_size`` rows."""
        n = min(batch_size, len(self._x))
        module = copy.deepcopy(self.module)  # a copy: the pass moves BatchNorm statistics
        owned = {p.untyped_storage().data_ptr() for p in module.parameters()}
        saved: dict[tuple[int, int], int] = {}  # (address, elements) -> bytes

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in owned:  # a parameter is no activation
                saved[t.data_ptr(), t.numel()] = t.numel() * t.element_size()
            return t

        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        x, y = self._x[:n].clone(), self._y[:n].clone()  # rows of their own, as index_select
        with torch.random.fork_rng(devices=cuda), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self.loss(module(x), y).mean()
        return sum(saved.values()) * batch_size // max(n, 1)

    def _shrink(self, settings: TaskSettings, failed: int) -> int:
        """Auto chunk size after a chunk of ``failed`` clients ran out of device memory:
        half of it, from now on at this batch size."""
        size = max(1, failed // 2)
        log.warning("vmap on %s: a chunk of %d clients ran out of memory; retrying with %d",
                    self.device_name, failed, size)
        self._auto_chunks[settings.batch_size] = self.chunk_size = size
        self.sizing = f"{self._sized}; cut to {size} after running out of memory"
        torch.cuda.empty_cache()
        return size


class HostBlocks:
    """The host memory chunks' trained vectors are read back into, reused from round to round
    once nothing holds a block's vectors any more.

    A fresh ``(clients, size)`` block per chunk faults in every page of it (4 GB for 1,000
    clients of a 1M-parameter model), and on CUDA a copy into pageable memory is staged
    through the driver; a kept block, pinned on CUDA (up to :data:`MAX_PINNED_BYTES` in all),
    is written straight by the copy engine. A block is reused only when no view of it survives:
    a chunk's results are views of its block, held until their clients push. The blocks kept
    are as many as one round's chunks held at once (at most :data:`MAX_HOST_BLOCKS`), the
    memory the round needs anyway.
    """

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self._blocks: list[tuple[torch.Tensor, npt.NDArray[np.float32]]] = []
        self.pinned_bytes = 0
        self.reused = 0

    def take(self, rows: int, cols: int) -> tuple[torch.Tensor, npt.NDArray[np.float32]]:
        """A ``(rows, cols)`` float32 block: a host tensor and the array sharing its memory."""
        for entry in self._blocks:
            array = entry[1]
            # the list's tuple, this local and the call's argument: no view of it survives
            if array.shape[1] == cols and array.shape[0] >= rows \
                    and sys.getrefcount(array) <= 3:
                self.reused += 1
                return entry[0][:rows], array[:rows]
        nbytes = rows * cols * 4
        pin = self.pin and self.pinned_bytes + nbytes <= MAX_PINNED_BYTES
        tensor = torch.empty((rows, cols), dtype=torch.float32, pin_memory=pin)
        array = tensor.numpy()
        if len(self._blocks) < MAX_HOST_BLOCKS:
            self._blocks.append((tensor, array))
            self.pinned_bytes += nbytes if pin else 0
        return tensor, array


def torch_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, checked (:func:`resolve_device`); bare ``cuda`` gets
    its index, so that logs and summaries name the GPU."""
    dev = torch.device(resolve_device(device) if isinstance(device, str) else device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def upload(array: npt.NDArray[np.generic], device: torch.device, what: str) -> torch.Tensor:
    """The training data's ``what`` as a tensor on ``device`` (once per executor)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return host
    try:
        return host.to(device)
    except torch.cuda.OutOfMemoryError:
        raise ValueError(f"the training data's {what} ({host.nbytes / 2**30:.2f} GiB) does not "
                         f"fit in the free memory of {device}; use device='cpu'") from None


__all__ = ["AUTO_MEMORY_FRACTION", "MAX_AUTO_CHUNK", "MAX_HOST_BLOCKS", "MAX_PINNED_BYTES",
           "ChunkSizing", "HostBlocks", "torch_device", "upload"]
