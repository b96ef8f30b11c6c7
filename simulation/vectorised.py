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
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from murmura.protocols import ModelSpec, TaskSettings
from murmura.simulation.execution import Executor, Index, Job, JobResult, ModelFactory
from murmura.tasks import ArrayDataset

log = logging.getLogger(__name__)

PerSampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_BATCH_STATS = (nn.modules.batchnorm._BatchNorm,)
_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
           nn.FeatureAlphaDropout)


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


class VectorisedExecutor(Executor):
    """Trains a batch of clients with one vmapped step function per local step.

    Jobs may carry their own step counts (``Job.steps``): clients with fewer steps are
    inactive on the rest, so one batch trains clients given different amounts of work.

    ``model_factory`` builds the template module (its values are never used, only its
    structure); ``shares[c]`` indexes client ``c``'s examples in ``train``.
    """

    path = "vmap"

    def __init__(self, model_factory: ModelFactory, train: ArrayDataset,
                 shares: Sequence[Index], *, chunk_size: int = 1024,
                 loss: PerSampleLoss = _cross_entropy, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if weight_decay < 0 or max_grad_norm < 0:
            raise ValueError("weight_decay and max_grad_norm must be >= 0")
        self.model_factory = model_factory
        self.model = model_factory()
        self.model.train()
        self.spec = ModelSpec.from_module(self.model)
        self.train = train
        self.shares = shares
        self.chunk_size = chunk_size
        self.loss = loss
        self.weight_decay = weight_decay
        self.max_grad_norm = max_grad_norm
        self._x = torch.from_numpy(np.ascontiguousarray(train.x))
        self._y = torch.from_numpy(np.ascontiguousarray(train.y))
        self.batch_stats = any(isinstance(m, _BATCH_STATS) for m in self.model.modules())
        self.random = any(isinstance(m, _RANDOM) for m in self.model.modules())
        self._layout()
        self._step = vmap(grad_and_value(self._loss), in_dims=(0, 0, 0, 0, 0),
                          randomness="different")

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
        self.local_state = {n: v.detach().clone() for n, v in state.items()
                            if n not in self.offsets}

    def _loss(self, params: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
              x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = functional_call(self.model, (params, state), (x,))
        per = self.loss(out, y)
        return (per * mask).sum() / mask.sum().clamp(min=1.0)

    def describe(self) -> str:
        grouped = ", grouped by data size for BatchNorm" if self.batch_stats else ""
        return (f"vmap (torch.func.vmap over stacked parameters, chunks of up to "
                f"{self.chunk_size} clients{grouped})")

    # -- running -------------------------------------------------------------------------

    def run(self, jobs: Sequence[Job], settings: TaskSettings) -> list[JobResult]:
        results: list[JobResult | None] = [None] * len(jobs)
        groups: dict[int, list[int]] = defaultdict(list)
        for k, job in enumerate(jobs):
            key = len(self.shares[job.client]) if self.batch_stats else 0
            groups[key].append(k)
        for key in sorted(groups):
            members = groups[key]
            for start in range(0, len(members), self.chunk_size):
                chunk = members[start:start + self.chunk_size]
                trained = self._run_chunk([jobs[k] for k in chunk], settings)
                for k, r in zip(chunk, trained, strict=True):
                    results[k] = r
        return [r for r in results if r is not None]

    def _run_chunk(self, jobs: Sequence[Job], settings: TaskSettings) -> list[JobResult]:
        c = len(jobs)
        sizes = [len(self.shares[j.client]) for j in jobs]
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
            stacked = np.stack([self.shares[j.client] for j in jobs])     # (c, n)
            idx = np.take_along_axis(stacked, safe.reshape(c, -1), axis=1).reshape(safe.shape)
        else:
            idx = np.empty_like(safe)
            for i, job in enumerate(jobs):
                idx[i] = self.shares[job.client][safe[i]]
        idx[~valid] = 0
        counts = valid.sum(axis=2)                                   # (c, steps)
        idx_t = torch.from_numpy(idx)
        mask_t = torch.from_numpy(valid.astype(np.float32))
        active_t = torch.from_numpy(counts > 0)

        base = torch.from_numpy(np.stack([np.asarray(j.params, dtype=np.float32)
                                          for j in jobs]))
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
        loss_sum = torch.zeros(c, dtype=torch.float64)
        torch.manual_seed(_chunk_seed(jobs))  # dropout masks: reproducible for this batch
        for s in range(steps):
            w = int(counts[:, s].max())
            # index_select on the flat indices: the same rows as x[idx] at a quarter of the
            # cost of advanced indexing, which took a tenth of a 1,000-client round
            flat = idx_t[:, s, :w].reshape(-1)
            xb = torch.index_select(self._x, 0, flat).view(c, w, *self._x.shape[1:])
            yb = torch.index_select(self._y, 0, flat).view(c, w, *self._y.shape[1:])
            mb = mask_t[:, s, :w]
            act = active_t[:, s]
            partial = not bool(act.all())
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
            loss_sum += torch.where(act, loss.detach().double() * mb.sum(1).double(), 0.0)
        out = np.empty((c, self.spec.size), dtype=np.float32)
        for name, off in self.offsets.items():
            value = params[name] if name in params else state[name]
            out[:, off:off + self.tensor_spec[name].numel] = \
                value.detach().reshape(c, -1).to(torch.float32).numpy()
        seen = np.maximum(valid.sum(axis=(1, 2)), 1).tolist()
        losses = loss_sum.numpy().tolist()
        active_steps = counts.astype(bool).sum(axis=1).tolist()
        return [JobResult(out[i], sizes[i], {"train_loss": losses[i] / seen[i],
                                             "steps": float(active_steps[i])})
                for i in range(c)]

    # -- checking ------------------------------------------------------------------------

    def probe(self, settings: TaskSettings, *, tolerance: float = 1e-4) -> str:
        """Run two clients for two steps; compare with the trainer unless the model is random.

        Raises :class:`VectorisationError` when vmap fails or disagrees with the trainer.
        Returns a short note on what was checked.
        """
        from murmura.simulation.execution import LoopExecutor

        probe = TaskSettings(local_steps=2, local_epochs=settings.local_epochs or 1,
                             batch_size=settings.batch_size, lr=settings.lr,
                             momentum=settings.momentum)
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
            scale = max(float(np.abs(w.params).max()), 1.0)
            err = float(np.abs(g.params - w.params).max()) / scale
            if not err <= tolerance:
                raise VectorisationError(f"vmap result differs from the trainer by {err:.2e} "
                                         f"(relative), more than {tolerance:.0e}")
        return "probe matched the trainer"


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


__all__ = ["VectorisationError", "VectorisedExecutor", "local_schedule", "schedule_length"]
