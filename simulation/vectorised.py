"""Vectorised local training: many clients' SGD at once with ``torch.func``.

Clients that share a model architecture train together. Their parameters are stacked along a
new leading dimension and each local step is one call of
``vmap(grad_and_value(loss))`` over ``functional_call`` of a single template module. The
step reproduces :class:`~murmura.client.TorchTrainer` client by client: the same batches (each
client's permutation comes from a generator seeded like the trainer's), cross-entropy averaged
over the batch, and ``torch.optim.SGD``'s update (weight decay, then momentum, then the step).
What differs is the order of float additions inside batched matrix products, so the result
matches the trainer to within float32 rounding, not bit for bit (the tests bound it).

Pitfalls handled here:

* **Randomness.** ``vmap(..., randomness="different")``: every client draws its own dropout
  mask. Masks come from torch's global generator, seeded per batch of clients from the clients'
  seeds, so a rerun is identical; they are not the masks the sequential trainer would draw.
* **Buffers.** Every client gets its own copy of every buffer (BatchNorm running statistics
  and its integer step counter), so in-place buffer updates never cross clients.
* **Clients with nothing to do.** Clients with fewer batches than the longest one in the batch
  are *inactive* on the remaining steps: their parameters, momentum and buffers are kept as
  they were with ``torch.where`` (a zero gradient would still move them under momentum or
  weight decay).
* **Ragged batches.** Without BatchNorm, short batches are padded and the padding is masked
  out of the loss. With BatchNorm, padding would leak into the batch statistics, so clients
  are grouped by data size instead, and a group's batches are exactly the trainer's.
* **Per-client clipping.** ``max_grad_norm`` clips each client's gradient by its own norm.

A model ``vmap`` can't run (data-dependent control flow, ``.item()``, tied weights...) fails
the :meth:`VectorisedExecutor.probe`, and the simulation falls back to the loop or the pool.

On an accelerator (``device='cuda'``, ``'mps'``) the same steps run there, with as little
traffic as possible between host and device:

* **once, at construction**: the training data (every client's examples, ``train.x`` and
  ``train.y``) is uploaded; every batch is then an ``index_select`` on the device;
* **once per chunk**: the distinct global vectors the chunk's jobs start from (usually one),
  the index, mask and activity tensors of the chunk's schedule; stacked parameters, momentum
  and buffers are built on the device and stay there for all the chunk's steps, whose loop
  has no host synchronisation;
* **once per chunk, back**: the trained parameters as one ``(clients, size)`` float32 block
  (one device-to-host copy, with the per-client losses read in the same synchronisation),
  handed on as the float32 numpy vectors the rest of the simulator expects.

The schedules (each client's permutations) are drawn on the CPU, as the trainer draws them, so
a client's batches are the same on every device; results differ from the CPU's by float32
rounding only (reductions run in another order on a GPU).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from murmura.protocols import ModelSpec, TaskSettings
from murmura.simulation.config import AMP, CPU_CHUNK, ZO_AMP
from murmura.simulation.device_memory import (
    AUTO_MEMORY_FRACTION,
    ChunkSizing,
    HostBlocks,
    torch_device,
    upload,
)
from murmura.simulation.execution import Executor, Index, Job, JobResult, ModelFactory
from murmura.simulation.schedules import (
    ChunkSchedule,
    chunk_schedule,
    local_schedule,
    schedule_length,
)
from murmura.simulation.schedules import to_device as _to
from murmura.simulation.vectorised_zo import run_zo_chunk
from murmura.tasks import ArrayDataset

log = logging.getLogger(__name__)

PerSampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_BATCH_STATS = (nn.modules.batchnorm._BatchNorm,)
_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
           nn.FeatureAlphaDropout)
#: The probe's relative tolerance with bf16 autocast (against the float32 trainer): two steps
#: of bfloat16 products (8 significant bits) move the parameters by about 1e-3 of their scale.
AMP_TOLERANCE = 1e-2


class VectorisationError(RuntimeError):
    """The model can't be trained with ``torch.func.vmap``; use the loop or the pool."""


def _cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy, ``logsumexp(z) - z[y]``: the same function as
    ``F.cross_entropy(reduction='none')``, about twice as fast under ``vmap``.

    Logits with positions (``(N, C, d1, ...)``, a language model's ``(N, V, T)``) give each
    sample's mean over its positions: with equal-length samples the batch mean is then the
    trainer's ``F.cross_entropy`` (a mean over every position)."""
    if logits.dim() > 2:
        z = logits.movedim(1, -1)
        per = torch.logsumexp(z, dim=-1) - z.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        return per.flatten(1).mean(1)
    return torch.logsumexp(logits, dim=-1) - logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)


class VectorisedExecutor(ChunkSizing, Executor):
    """Trains a batch of clients with one vmapped step function per local step.

    Jobs may carry their own step counts (``Job.steps``): clients with fewer steps are
    inactive on the rest, so one batch trains clients given different amounts of work.

    ``model_factory`` builds the template module (its values are never used, only its
    structure); ``shares[c]`` indexes client ``c``'s examples in ``train``.

    ``device`` (``cpu``, ``cuda``, ``cuda:N``, ``mps``, ``auto``, or a ``torch.device``) is
    where training runs; ``train`` is uploaded there once, here. ``chunk_size`` is the most
    clients trained in one vmapped batch; ``0`` sizes it automatically: on CUDA from the free
    device memory (``memory_fraction`` of it) and one client's footprint
    (:meth:`client_footprint`) at the first batch size it sees, elsewhere
    :data:`~murmura.simulation.config.CPU_CHUNK`.

    ``amp='bf16'`` runs each step's forward and backward passes under bfloat16 autocast; the
    stacked parameters, their gradients, momentum and the losses stay float32 (the trainer's
    ``amp='bf16'``). Zeroth-order chunks refuse it (see ``SimulationConfig.amp``).
    """

    path = "vmap"

    def __init__(self, model_factory: ModelFactory, train: ArrayDataset,
                 shares: Sequence[Index], *, chunk_size: int = CPU_CHUNK,
                 loss: PerSampleLoss = _cross_entropy, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, device: str | torch.device = "cpu",
                 memory_fraction: float = AUTO_MEMORY_FRACTION, amp: str = "off") -> None:
        if amp not in AMP:
            raise ValueError(f"amp must be 'off' or 'bf16', got {amp!r}")
        if chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 1, or 0 (auto), got {chunk_size}")
        if weight_decay < 0 or max_grad_norm < 0:
            raise ValueError("weight_decay and max_grad_norm must be >= 0")
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must lie in (0, 1], got {memory_fraction}")
        self.device = torch_device(device)
        self.device_name = str(self.device)
        #: bfloat16 autocast around the forward and backward passes, or None (float32)
        self.amp = torch.bfloat16 if amp == "bf16" else None
        self.model_factory = model_factory
        self.model = model_factory()
        self.model.train()
        self.spec = ModelSpec.from_module(self.model)
        self.train = train
        self.shares = shares
        #: What was asked for (0: auto) and what the chunks are (0 until auto has sized them,
        #: at the first batch on CUDA).
        self.requested_chunk = chunk_size
        self.chunk_size = chunk_size or (0 if self.device.type == "cuda" else CPU_CHUNK)
        self.memory_fraction = memory_fraction
        self._auto_chunks: dict[int, int] = {}  # batch size -> clients per chunk
        self.sizing = self._sized = ""  # how auto chose the chunk size (for describe())
        self.loss = loss
        self.weight_decay = weight_decay
        self.max_grad_norm = max_grad_norm
        self.batch_stats = any(isinstance(m, _BATCH_STATS) for m in self.model.modules())
        self.random = any(isinstance(m, _RANDOM) for m in self.model.modules())
        self._layout()
        # the module functional_call runs: the template itself on the CPU, a copy on the device
        # elsewhere (buffers it does not take from the stacked state must live there too)
        self.module = self.model if self.device.type == "cpu" \
            else copy.deepcopy(self.model).to(self.device)
        self._x = upload(train.x, self.device, "x")
        self._y = upload(train.y, self.device, "y")
        self._step = vmap(grad_and_value(self._loss), in_dims=(0, 0, 0, 0, 0),
                          randomness="different")
        #: where trained chunks land on the host (pinned on CUDA), reused from chunk to chunk
        self._host = HostBlocks(pin=self.device.type == "cuda")
        #: the zeroth-order path's vmapped losses, built on its first chunk (an eval() copy
        #: of the module: simulation/vectorised_zo.py)
        self.zo_losses: Callable[..., torch.Tensor] | None = None

    # -- structure -----------------------------------------------------------------------

    def _layout(self) -> None:
        state = self.model.state_dict(keep_vars=True)
        if len({id(v) for v in state.values()}) != len(state):
            raise VectorisationError("the model shares tensors between names (tied weights)")
        self.trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
        spec_names = [t.name for t in self.spec.tensors]
        missing = set(self.trainable) - set(spec_names)
        if missing:
            raise VectorisationError(f"parameters {sorted(missing)} are not in the model spec")
        self.offsets = dict(zip(spec_names, self.spec.offsets(), strict=True))
        self.tensor_spec = {t.name: t for t in self.spec.tensors}
        self.dtypes = {n: v.dtype for n, v in state.items()}
        # state that is not in the flat vector (e.g. BatchNorm's num_batches_tracked)
        self.local_state = {n: v.detach().clone().to(self.device) for n, v in state.items()
                            if n not in self.offsets}

    def _loss(self, params: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
              x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.amp or torch.float32,
                            enabled=self.amp is not None):
            out = functional_call(self.module, (params, state), (x,))
        if self.amp is not None:  # the loss in float32, as autocast's own policy has it
            out = out.float()
        per = self.loss(out, y)
        return (per * mask).sum() / mask.sum().clamp(min=1.0)

    def describe(self) -> str:
        grouped = ", grouped by data size for BatchNorm" if self.batch_stats else ""
        if self.requested_chunk:
            size = f"up to {self.chunk_size} clients"
        elif self.chunk_size:
            size = f"up to {self.chunk_size} clients (auto{self.sizing})"
        else:
            size = "sized automatically at the first batch"
        amp = ", bf16 autocast" if self.amp is not None else ""
        return (f"vmap on {self.device_name} (torch.func.vmap over stacked parameters, chunks "
                f"of {size}{grouped}{amp})")

    # -- running -------------------------------------------------------------------------

    def run(self, jobs: Sequence[Job], settings: TaskSettings) -> list[JobResult]:
        results: list[JobResult | None] = [None] * len(jobs)
        groups: dict[int, list[int]] = defaultdict(list)
        for k, job in enumerate(jobs):
            key = len(self.shares[job.client]) if self.batch_stats else 0
            groups[key].append(k)
        size = self.chunk_for(settings) if jobs else self.chunk_size
        for key in sorted(groups):
            members = groups[key]
            start = 0
            while start < len(members):
                chunk = members[start:start + size]
                try:
                    trained = self._run_chunk([jobs[k] for k in chunk], settings)
                except torch.cuda.OutOfMemoryError:
                    if self.requested_chunk or len(chunk) == 1:
                        raise
                    trained = None  # retried below, once the failed chunk's memory is free
                if trained is None:
                    size = self._shrink(settings, len(chunk))
                    continue
                for k, r in zip(chunk, trained, strict=True):
                    results[k] = r
                start += len(chunk)
        return [r for r in results if r is not None]

    def schedule(self, jobs: Sequence[Job], settings: TaskSettings) -> ChunkSchedule:
        """The chunk's batches, drawn as each client's trainer would draw them, with the
        index, mask and activity tensors on the device (one upload per chunk)."""
        return chunk_schedule(self.shares, jobs, settings, self.device)

    def batch(self, plan: ChunkSchedule, s: int) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
        """Step ``s``'s rows, labels and mask for every client of the chunk, on the device."""
        c = len(plan.sizes)
        w = int(plan.counts[:, s].max())
        # index_select on the flat indices: the same rows as x[idx] at a quarter of the
        # cost of advanced indexing, which took a tenth of a 1,000-client round
        flat = plan.idx[:, s, :w].reshape(-1)
        xb = torch.index_select(self._x, 0, flat).view(c, w, *self._x.shape[1:])
        yb = torch.index_select(self._y, 0, flat).view(c, w, *self._y.shape[1:])
        return xb, yb, plan.mask[:, s, :w]

    def _run_chunk(self, jobs: Sequence[Job], settings: TaskSettings) -> list[JobResult]:
        if settings.trainer == "zo":
            if self.amp is not None:
                raise ValueError(ZO_AMP)
            return run_zo_chunk(self, jobs, settings)
        c = len(jobs)
        plan = self.schedule(jobs, settings)
        sizes, valid, counts, active = plan.sizes, plan.valid, plan.counts, plan.active
        active_t = plan.active_t
        steps = counts.shape[1]
        dev = self.device

        base = self.stack_params(jobs)
        params: dict[str, torch.Tensor] = {}
        state: dict[str, torch.Tensor] = {}
        for name, off in self.offsets.items():
            t = self.tensor_spec[name]
            value = base[:, off:off + t.numel].reshape(c, *t.shape).to(self.dtypes[name])
            (params if name in self.trainable else state)[name] = value.contiguous()
        for name, value in self.local_state.items():
            state[name] = value.unsqueeze(0).expand(c, *value.shape).clone()
        momentum = settings.momentum
        bufs: dict[str, torch.Tensor] = {}
        # MPS has no float64; elsewhere the losses add up in float64, as the trainer's do
        loss_sum = torch.zeros(c, dtype=torch.float32 if dev.type == "mps" else torch.float64,
                               device=dev)
        torch.manual_seed(_chunk_seed(jobs))  # dropout masks: reproducible for this batch
        for s in range(steps):
            xb, yb, mb = self.batch(plan, s)
            act = active_t[:, s]
            partial = not bool(active[:, s].all())  # from the host copy: no device sync
            before = {n: v.clone() for n, v in state.items()} if partial else {}
            grads, loss = self._step(params, state, xb, yb, mb)
            if self.max_grad_norm:
                grads = _clip_per_client(grads, self.max_grad_norm)
            for name in self.trainable:
                p, g = params[name], grads[name]
                if self.weight_decay:
                    g = g.add(p, alpha=self.weight_decay)
                if momentum:
                    if s == 0:
                        bufs[name] = g.clone()
                    else:
                        bufs[name] = _where(act, bufs[name].mul(momentum).add(g), bufs[name])
                    g = bufs[name]
                params[name] = _where(act, p.add(g, alpha=-settings.lr), p) if partial \
                    else p.add(g, alpha=-settings.lr)
            for name, old in before.items():
                state[name] = _where(act, state[name], old)
            loss_sum += torch.where(act, loss.detach().to(loss_sum.dtype)
                                    * mb.sum(1).to(loss_sum.dtype), 0.0)
        out, losses = self._read_back(params, state, loss_sum, c)
        seen = np.maximum(valid.sum(axis=(1, 2)), 1).tolist()
        active_steps = active.sum(axis=1).tolist()
        return [JobResult(out[i], sizes[i], {"train_loss": losses[i] / seen[i],
                                             "steps": float(active_steps[i])})
                for i in range(c)]

    def stack_params(self, jobs: Sequence[Job]) -> torch.Tensor:
        """The jobs' start vectors as a ``(clients, size)`` float32 tensor on the device.

        Jobs of one batch mostly start from the same global vector: each distinct vector is
        copied (and uploaded) once, then repeated on the device."""
        keys: dict[int, int] = {}
        vectors: list[npt.NDArray[np.float32]] = []
        which: list[int] = []
        for job in jobs:
            k = keys.get(id(job.params))
            if k is None:
                k = keys[id(job.params)] = len(vectors)
                vectors.append(np.asarray(job.params, dtype=np.float32))
            which.append(k)
        distinct = _to(torch.from_numpy(np.stack(vectors)), self.device)
        if len(vectors) == len(jobs):
            return distinct
        return distinct.index_select(0, _to(torch.tensor(which), self.device))

    def _read_back(self, params: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                   loss_sum: torch.Tensor, c: int) -> tuple[npt.NDArray[np.float32],
                                                        list[float]]:
        """The trained ``(clients, size)`` float32 block and each client's loss sum, on the
        host: on an accelerator, one device-to-host copy of the block and one
        synchronisation."""
        def value(name: str) -> torch.Tensor:
            v = params[name] if name in params else state[name]
            return v.detach().reshape(c, -1).to(torch.float32)

        if self.device.type == "cpu":
            out = self._host.take(c, self.spec.size)[1]
            for name, off in self.offsets.items():
                out[:, off:off + self.tensor_spec[name].numel] = value(name).numpy()
            return out, loss_sum.numpy().tolist()
        cuda = self.device.type == "cuda"
        block = torch.cat([value(name) for name in self.offsets], dim=1)  # the spec's order
        host_loss = torch.empty(c, dtype=loss_sum.dtype, pin_memory=cuda)
        host_loss.copy_(loss_sum, non_blocking=cuda)
        out = self.to_host(block)  # waits for the stream: the losses' copy has landed too
        return out, host_loss.tolist()

    def to_host(self, block: torch.Tensor) -> npt.NDArray[np.float32]:
        """A ``(clients, size)`` float32 block on the device, as an array on the host: a kept
        host block (pinned on CUDA) when one is free (:class:`HostBlocks`), written by one
        copy; returns once the copy (and whatever the stream queued before it) has landed."""
        if self.device.type == "cpu":
            return block.numpy()  # type: ignore[no-any-return]
        cuda = self.device.type == "cuda"
        host, out = self._host.take(block.shape[0], block.shape[1])
        host.copy_(block, non_blocking=cuda and host.is_pinned())
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return out

    # -- checking ------------------------------------------------------------------------

    def probe(self, settings: TaskSettings, *, tolerance: float = 1e-4) -> str:
        """Run two clients for two steps; compare with the trainer unless the model is random.

        Raises :class:`VectorisationError` when vmap fails or disagrees with the trainer.
        Returns a short note on what was checked.
        """
        from murmura.simulation.execution import LoopExecutor

        if settings.trainer == "zo":  # the trainer's own settings: eps, q, the codec options
            probe = dataclasses.replace(settings, local_steps=2,
                                        local_epochs=settings.local_epochs or 1)
        else:
            probe = TaskSettings(local_steps=2, local_epochs=settings.local_epochs or 1,
                                 batch_size=settings.batch_size, lr=settings.lr,
                                 momentum=settings.momentum)
        if self.amp is not None:  # bfloat16 rounding against the float32 trainer
            tolerance = max(tolerance, AMP_TOLERANCE)
        params = self.spec.flatten(self.model)
        jobs = [Job(c, params, 1000 + c) for c in range(min(2, len(self.shares)))]
        try:
            got = self.run(jobs, probe)
        except Exception as exc:  # any failure inside torch.func means: not this path
            raise VectorisationError(f"{type(exc).__name__}: {exc}") from exc
        if self.random:
            return "probe ran; values not compared (the model draws random numbers)"
        want = LoopExecutor(self.model_factory, self.train, self.shares).run(jobs, probe)
        for g, w in zip(got, want, strict=True):
            if g.encoded is not None and w.encoded is not None:
                _same_step_seeds(g.encoded[1], w.encoded[1], probe)
            scale = max(float(np.abs(w.params).max()), 1.0)
            err = float(np.abs(g.params - w.params).max()) / scale
            if not err <= tolerance:
                raise VectorisationError(f"vmap result differs from the trainer by {err:.2e} "
                                         f"(relative), more than {tolerance:.0e}")
        return ("probe matched the trainer" if self.amp is None else
                f"probe matched the float32 trainer within {tolerance:g} (bf16 autocast)")


def _same_step_seeds(got: bytes, want: bytes, settings: TaskSettings) -> None:
    """Zeroth-order step logs must name the same seeds (the server replays the directions
    they name; the g values may differ by rounding, and the parameters compare those)."""
    from murmura.client.zo import seed_codec_for

    codec = seed_codec_for(settings)
    a, b = codec.unpack(got).seeds, codec.unpack(want).seeds
    if not np.array_equal(a, b):
        raise VectorisationError(f"vmap's zeroth-order steps drew seeds {a[:4].tolist()}..., "
                                 f"the trainer's {b[:4].tolist()}...")


def _where(active: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.where(active.view(-1, *([1] * (new.dim() - 1))), new, old)


def _clip_per_client(grads: dict[str, torch.Tensor], max_norm: float
                     ) -> dict[str, torch.Tensor]:
    sq = sum(g.pow(2).reshape(g.shape[0], -1).sum(1) for g in grads.values())
    scale = (max_norm / (torch.sqrt(sq) + 1e-6)).clamp(max=1.0)  # type: ignore[arg-type]
    return {n: g * scale.view(-1, *([1] * (g.dim() - 1))) for n, g in grads.items()}


def _chunk_seed(jobs: Sequence[Job]) -> int:
    # hashing a tuple of ints is deterministic across processes (no hash randomisation)
    return hash(tuple(int(j.seed) for j in jobs)) & (2**63 - 1)


__all__ = ["HostBlocks", "VectorisationError", "VectorisedExecutor", "local_schedule",
           "schedule_length"]
