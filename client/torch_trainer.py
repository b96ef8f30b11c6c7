"""First-order local SGD on a torch module: :class:`TorchTrainer`, the trainer most clients
use, with what it takes to keep a step on an accelerator fast.

The parameters travel in and out through one host-device copy each (page-locked on CUDA),
per-step losses stay on the device until the task ends, and the data is placed by
:mod:`murmura.client.placement`; a task's step can be captured in a CUDA graph
(:mod:`murmura.client.cuda_graph`). The interface every trainer shares is
:mod:`murmura.client.trainer`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from murmura.client.cuda_graph import (
    GRAPH_MIN_REPLAYS,
    GRAPH_WARMUP,
    _GraphedStep,
    full_batches,
)
from murmura.client.placement import (
    RESIDENT_FRACTION,
    _PlacedData,
    _torch_dtype,
    data_placement,
)
from murmura.client.trainer import (
    LossFn,
    Trainer,
    TrainResult,
    _seed_everything,
    count_examples,
    iter_batches,
)
from murmura.edge import amp_dtype, free_memory, resolve_device
from murmura.protocols import FlatVector, ModelSpec, TaskSettings
from murmura.tasks import ArrayDataset

#: Largest model (bytes of float32 parameters) staged through page-locked host memory.
STAGING_MAX_BYTES = 1 << 30


class _LossLog:
    """Per-step losses kept on the device (one copy per step, no host synchronisation) and
    read back once, at the end of the task."""

    CHUNK = 1024

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.chunks: list[torch.Tensor] = []
        self.used = self.CHUNK

    def add(self, loss: torch.Tensor) -> None:
        if self.used == self.CHUNK:
            self.chunks.append(torch.empty(self.CHUNK, dtype=torch.float32, device=self.device))
            self.used = 0
        self.chunks[-1][self.used].copy_(loss)
        self.used += 1

    def tensor(self) -> torch.Tensor:
        """All losses so far, in step order (float32, on the device)."""
        if not self.chunks:
            return torch.empty(0, dtype=torch.float32, device=self.device)
        last = self.chunks[-1][: self.used]
        return torch.cat([*self.chunks[:-1], last]) if len(self.chunks) > 1 else last


class TorchTrainer(Trainer):
    """Plain first-order local SGD on a torch module.

    ``data`` is an :class:`ArrayDataset` (batched here, shuffled from the task seed), a
    ``DataLoader``/iterable of ``(x, y)`` batches, or a zero-argument function returning one.

    **Data on the device.** On an accelerator an :class:`ArrayDataset` is copied to the device
    once (at the first task, again only when ``data`` is replaced) when it fits in
    ``resident_fraction`` of the free device memory (:func:`data_placement`): each epoch
    then shuffles it there with one gather and slices batches from it. Larger data is gathered
    batch by batch into page-locked host memory and copied without blocking. The permutation
    is always drawn on the CPU from the task seed, so the batches are the ones a CPU run takes.
    Replace the data set (as the client app does) rather than editing its arrays in place:
    the device copy is kept while ``data`` is the same object. Other data is moved batch by
    batch (non-blocking on CUDA; a ``DataLoader`` with ``pin_memory=True`` makes it async).

    **No host synchronisation per step.** Each step's loss is copied into a buffer on the
    device; the losses are read once, at the end of the task, with the new parameters (one
    transfer each, one synchronisation). ``train_loss`` is the same float64 sum of
    loss x batch size, in step order, as it always was.

    **Mixed precision.** ``amp`` picks it (:func:`murmura.edge.amp_dtype`): ``auto`` is
    bf16/fp16 autocast on CUDA and fp32 on the CPU, so CPU runs stay bit-identical to the
    simulator's; fp16 uses a gradient scaler, which reads its overflow flag every step (a host
    synchronisation: prefer bf16). bf16 only pays where arithmetic dominates a step: large
    layers and batches. A small model (the digits MLP, a few thousand parameters, batch 16)
    is bound by kernel launches, not arithmetic, and autocast adds cast kernels to every
    step, so it is slower than fp32 there; pass ``amp="off"`` for such models. On a host
    whose launches are slow even a 4M-parameter MLP at batch 256 is launch-bound in eager
    mode, and bf16 pays only with ``cuda_graph=True``.

    **CUDA graphs** (``cuda_graph=True``, CUDA only, fp32 or bf16, array data): after
    ``GRAPH_WARMUP`` eager steps the whole step (forward, backward, optimizer) is captured
    once per task and replayed for every whole batch; one launch per step instead of dozens.
    Used when a task has at least ``GRAPH_WARMUP + GRAPH_MIN_REPLAYS`` whole batches. The
    model's step must be capturable: static shapes, no host synchronisation (``.item()``,
    data-dependent Python control flow), no CPU tensors; capture fails loudly otherwise.
    Results equal the eager step's up to the kernels' own nondeterminism.

    ``micro_batch`` splits each batch into passes of that many rows with gradient accumulation
    (see :func:`murmura.edge.probe_micro_batch` for the largest that fits a memory cap).
    """

    def __init__(self, model: nn.Module, data: ArrayDataset | Iterable[Any] | Callable[[], Any],
                 *, loss_fn: LossFn = nn.functional.cross_entropy, device: str = "auto",
                 num_examples: int | None = None, weight_decay: float = 0.0,
                 amp: str = "auto", micro_batch: int = 0,
                 resident_fraction: float = RESIDENT_FRACTION,
                 cuda_graph: bool = False) -> None:
        self.device = resolve_device(device)
        self.amp_dtype = amp_dtype(self.device, amp)
        if micro_batch < 0:
            raise ValueError(f"micro_batch must be >= 0 (0: whole batches), got {micro_batch}")
        if not 0.0 <= resident_fraction <= 1.0:
            raise ValueError(f"resident_fraction must lie in [0, 1], got {resident_fraction}")
        #: Rows per forward/backward pass; batches above it accumulate gradients (memory).
        self.micro_batch = micro_batch
        self.model = model.to(self.device)
        self.spec = ModelSpec.from_module(self.model)
        self.data = data
        self.loss_fn = loss_fn
        self.weight_decay = weight_decay
        self._num_examples = num_examples
        #: Share of free device memory array data may take to be kept on the device.
        self.resident_fraction = resident_fraction
        #: Capture each task's step in a CUDA graph (see the class docstring).
        self.cuda_graph = cuda_graph
        self._placed: _PlacedData | None = None
        self._graph_stream: torch.cuda.Stream | None = None
        self._staging: torch.Tensor | None = None

    def num_examples(self) -> int:
        return count_examples(self.data, self._num_examples)

    @property
    def placement(self) -> str | None:
        """Where the array data was put at the last task (:func:`data_placement`), or None
        before the first task on an accelerator and for other data."""
        return "host" if self.device.type == "cpu" and isinstance(self.data, ArrayDataset) \
            else (self._placed.mode if self._placed is not None else None)

    # -- data ----------------------------------------------------------------------------

    def _place(self, source: ArrayDataset) -> _PlacedData:
        """``source`` on this trainer's accelerator, placed once per data set."""
        if self._placed is not None and self._placed.holds(source):
            return self._placed
        self._placed = None  # let a replaced data set's device copy go before sizing
        nbytes = int(source.x.nbytes) + int(source.y.nbytes)
        free = free_memory(self.device)
        if self.device.type == "cuda":  # plus what torch's allocator holds unused (reusable)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(
                self.device)
        mode = data_placement(nbytes, self.device.type, free, fraction=self.resident_fraction)
        placed = _PlacedData(source, source.x, source.y, mode)
        if mode == "device":
            with warnings.catch_warnings():  # read-only arrays: only ever read here
                warnings.simplefilter("ignore", UserWarning)
                placed.x = torch.from_numpy(np.ascontiguousarray(source.x)).to(self.device)
                placed.y = torch.from_numpy(np.ascontiguousarray(source.y)).to(self.device)
        self._placed = placed
        return placed

    def _array_batches(self, source: ArrayDataset, batch_size: int,
                       gen: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One epoch of ``source`` on the accelerator, in :func:`iter_batches`' order."""
        placed = self._place(source)
        n = len(source)
        perm = torch.randperm(n, generator=gen)  # on the CPU, as iter_batches draws it
        cuda = self.device.type == "cuda"
        if placed.mode == "device":
            assert placed.x is not None and placed.y is not None
            index = perm.pin_memory().to(self.device, non_blocking=True) if cuda \
                else perm.to(self.device)
            xs, ys = placed.x.index_select(0, index), placed.y.index_select(0, index)
            for s in range(0, n, batch_size):
                yield xs[s : s + batch_size], ys[s : s + batch_size]
            return
        x_type, y_type = _torch_dtype(source.x.dtype), _torch_dtype(source.y.dtype)
        order = perm.numpy()
        for s in range(0, n, batch_size):
            rows = order[s : s + batch_size]
            xb = torch.empty((len(rows), *source.x.shape[1:]), dtype=x_type, pin_memory=cuda)
            yb = torch.empty((len(rows), *source.y.shape[1:]), dtype=y_type, pin_memory=cuda)
            np.take(source.x, rows, axis=0, out=xb.numpy())
            np.take(source.y, rows, axis=0, out=yb.numpy())
            # pinned blocks come from the caching host allocator, which keeps each one until
            # its copy has run: the next batch never overwrites one still in flight
            yield xb.to(self.device, non_blocking=cuda), yb.to(self.device, non_blocking=cuda)

    def _batches(self, batch_size: int, gen: torch.Generator) -> Iterator[Any]:
        """One epoch of ``(x, y)`` batches on the device, in :func:`iter_batches`' order."""
        if self.device.type == "cpu":
            for x, y in iter_batches(self.data, batch_size, gen):
                yield x.to(self.device), y.to(self.device)
            return
        data = self.data
        source: Any = data() if callable(data) and not isinstance(data, ArrayDataset) else data
        if isinstance(source, ArrayDataset):
            yield from self._array_batches(source, batch_size, gen)
            return
        cuda = self.device.type == "cuda"
        for x, y in source:
            yield x.to(self.device, non_blocking=cuda), y.to(self.device, non_blocking=cuda)

    # -- parameters in and out -----------------------------------------------------------

    def _load(self, params: FlatVector) -> None:
        """``params`` into the model: on an accelerator with one host-to-device copy."""
        if self.device.type == "cpu":
            self.spec.load_into(self.model, params)
            return
        self.spec.check_vector(params)
        source = np.ascontiguousarray(params, dtype=np.float32)
        staging = self._staging_buffer()
        if staging is not None:  # a host copy into page-locked memory, then a DMA from it
            staging.numpy()[:] = source
            flat = staging.to(self.device, non_blocking=True)
        else:
            flat = torch.from_numpy(source).to(self.device)
        state = _float_tensors(self.model)
        with torch.no_grad():
            for t, off in zip(self.spec.tensors, self.spec.offsets(), strict=True):
                state[t.name].copy_(flat[off : off + t.numel].view(t.shape))

    def _read_back(self, log: _LossLog) -> tuple[FlatVector, list[float]]:
        """The model's flat vector and every step's loss, read with one synchronisation."""
        if self.device.type == "cpu":
            return self.spec.flatten(self.model), log.tensor().tolist()
        state = _float_tensors(self.model)
        parts = []
        for t in self.spec.tensors:
            value = state.get(t.name)
            if value is None or tuple(value.shape) != t.shape:
                raise ValueError(f"module does not match spec at tensor {t.name!r}")
            parts.append(value.detach().reshape(-1).to(torch.float32))
        cuda = self.device.type == "cuda"
        losses = log.tensor().to("cpu", non_blocking=cuda)
        staging = self._staging_buffer()
        if staging is None:
            flat = torch.cat(parts).cpu()  # waits for the stream, the losses' copy included
            return flat.numpy(), losses.tolist()
        for part, off in zip(parts, self.spec.offsets(), strict=True):
            staging[off : off + part.numel()].copy_(part, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return staging.numpy().copy(), losses.tolist()

    def _staging_buffer(self) -> torch.Tensor | None:
        """A page-locked host vector the parameters travel through on CUDA (None elsewhere,
        and for models over :data:`STAGING_MAX_BYTES`).

        Copies from pageable memory run at a fraction of the link's speed (the driver stages
        them through its own small pinned buffer): 17 MB each way took 2-3 ms on an H100
        host, a few percent of a short task. Reused for every task; a task's read-back has
        finished with it before the next task's parameters are written into it.
        """
        if self.device.type != "cuda" or 4 * self.spec.size > STAGING_MAX_BYTES:
            return None
        if self._staging is None:
            self._staging = torch.empty(self.spec.size, dtype=torch.float32, pin_memory=True)
        return self._staging

    # -- one step ------------------------------------------------------------------------

    def _backward(self, x: torch.Tensor, y: torch.Tensor, amp: torch.dtype | None,
                  scaler: torch.amp.GradScaler, cache: bool = True) -> torch.Tensor:
        """Gradients of the batch's mean loss, in micro-batches of ``micro_batch`` rows when
        set (each micro-batch's loss weighted by its share of the batch: the same gradient
        for a mean-reduced loss and a model without batch statistics); returns the loss.
        ``cache=False`` turns autocast's weight cache off (required inside a CUDA graph)."""
        mb = self.micro_batch if self.micro_batch and len(y) > self.micro_batch else len(y)
        if mb == len(y) and amp is None:
            # One full-precision pass (the common CPU case): the same arithmetic as the loop
            # below, without its per-step split, autocast and accumulator overheads.
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss.detach().float()
        total = torch.zeros((), device=x.device)
        for xc, yc in zip(x.split(mb), y.split(mb), strict=True):
            with torch.autocast(self.device.type, dtype=amp or torch.float32,
                                enabled=amp is not None, cache_enabled=cache):
                loss = self.loss_fn(self.model(xc), yc)
            part = loss * (len(yc) / len(y)) if mb < len(y) else loss
            (scaler.scale(part) if amp is not None else part).backward()
            total += part.detach().float()
        return total

    def _step(self, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer,
              weights: Sequence[torch.Tensor], amp: torch.dtype | None,
              scaler: torch.amp.GradScaler, cache: bool = True) -> torch.Tensor:
        """One SGD step on ``(x, y)``; returns the loss (a device tensor, not read)."""
        for p in weights:  # opt.zero_grad(set_to_none=True), minus its profiler hooks
            p.grad = None
        loss = self._backward(x, y, amp, scaler, cache)
        if amp is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        return loss

    def _uses_graph(self, settings: TaskSettings) -> bool:
        """Whether this task's step is captured in a CUDA graph (see the class docstring)."""
        return (self.cuda_graph and self.device.type == "cuda"
                and self.amp_dtype is not torch.float16 and isinstance(self.data, ArrayDataset)
                and full_batches(len(self.data), settings) >= GRAPH_WARMUP + GRAPH_MIN_REPLAYS)

    def train(self, params: FlatVector, settings: TaskSettings, *, seed: int) -> TrainResult:
        gen = _seed_everything(seed)
        self._load(params)
        self.model.train()
        weights = list(self.model.parameters())
        opt = torch.optim.SGD(weights, lr=settings.lr,
                              momentum=settings.momentum, weight_decay=self.weight_decay)
        amp = self.amp_dtype
        scaler = torch.amp.GradScaler(self.device.type, enabled=amp is torch.float16)
        graph: _GraphedStep | None = None
        if self._uses_graph(settings):
            if self._graph_stream is None:
                self._graph_stream = torch.cuda.Stream(self.device)
            graph = _GraphedStep(self, opt, weights, amp, scaler, self._graph_stream)
        log = _LossLog(self.device)
        sizes: list[int] = []
        epochs = settings.local_epochs if settings.local_steps == 0 else 10**9
        for _ in range(epochs):
            for x, y in self._batches(settings.batch_size, gen):
                if graph is not None and len(y) == settings.batch_size:
                    loss = graph(x, y)
                else:
                    loss = self._step(x, y, opt, weights, amp, scaler)
                log.add(loss)
                sizes.append(len(y))
                if settings.local_steps and len(sizes) >= settings.local_steps:
                    break
            if settings.local_steps and len(sizes) >= settings.local_steps:
                break
        if not sizes:
            raise ValueError("the local data yielded no batch")
        flat, losses = self._read_back(log)
        if graph is not None:  # the captured gradients belong to the graph's memory pool
            for p in weights:
                p.grad = None
        loss_sum = 0.0
        for value, size in zip(losses, sizes, strict=True):  # the float64 sum, in step order
            loss_sum += value * size
        return TrainResult(flat, self.num_examples(),
                           {"train_loss": loss_sum / max(sum(sizes), 1),
                            "steps": float(len(sizes))})


def _float_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's floating state by name, as :class:`ModelSpec` covers it."""
    return {name: value.data if isinstance(value, nn.Parameter) else value
            for name, value in module.state_dict(keep_vars=True).items()
            if torch.is_floating_point(value)}
