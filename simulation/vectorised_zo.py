"""Zeroth-order local training of a chunk of clients at once (the vectorised executor's
``trainer = "zo"`` path).

Each client does what :class:`~murmura.client.ZOTrainer` does, on its own batches (drawn as
the trainer draws them) and with its own seed stream, so its step log names exactly the seeds
the trainer's would. Per direction, the chunk's ``(clients, size)`` parameter block is moved
by ``+eps z``, ``-2 eps z`` and ``eps + c`` times ``z`` (each row its own ``z``, drawn for all
rows in one pass by :func:`~murmura.protocols.prng.rademacher_rows`), and the two losses of
every client come from one ``vmap`` of the model's forward pass. The host reads both loss
vectors once per direction (one synchronisation on an accelerator) and records each client's
step in its own encoder; what goes on the wire is that log, which the server replays exactly.

What differs from the trainer is the order of float additions inside batched products, so a
client's losses, hence its ``g`` values, match the trainer's to float32 rounding, not bit for
bit (the tests bound the difference). The module runs in ``eval()`` mode, as the trainer's:
a forward pass is a pure function of the parameters.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from murmura.client.zo import SEED_CODEC, check_step_budget, seed_codec_for
from murmura.protocols import TaskSettings, prng
from murmura.simulation.execution import Job, JobResult

if TYPE_CHECKING:
    from murmura.simulation.vectorised import VectorisedExecutor

__all__ = ["run_zo_chunk"]


def run_zo_chunk(ex: VectorisedExecutor, jobs: Sequence[Job],
                 settings: TaskSettings) -> list[JobResult]:
    """Train ``jobs`` (one chunk) with zeroth-order steps; each result carries its client's
    ``("seed", payload)`` step log and the parameters the steps reached (up to rounding; the
    exact model is the server's replay of the log)."""
    c, size = len(jobs), ex.spec.size
    codec = seed_codec_for(settings)
    plan = ex.schedule(jobs, settings)
    steps = plan.counts.shape[1]
    check_step_budget(steps, codec)
    encoders = [codec.encoder(size, seed=job.seed) for job in jobs]
    pool = codec.pool(settings.seed)
    picks = [np.random.default_rng(job.seed) for job in jobs] if pool is not None else []
    eps = float(np.float32(settings.zo_eps))
    dev = ex.device
    theta = ex.stack_params(jobs)  # (c, size), a fresh block: each row one client's model
    loss_of = ex.zo_losses
    if loss_of is None:  # once per executor: the module copy is not remade per chunk
        loss_of = ex.zo_losses = _losses(ex)
    loss_sum, g_abs = [0.0] * c, [0.0] * c
    kept, skipped = [0] * c, [0] * c
    # coefficient columns: every row moves by its own multiple of its own z
    coeff = np.zeros((c, 1), dtype=np.float32)
    with torch.no_grad():
        for s in range(steps):
            xb, yb, mb = ex.batch(plan, s)
            active = np.flatnonzero(plan.active[:, s]).tolist()
            on = np.zeros((c, 1), dtype=np.float32)
            on[active] = 1.0
            on_t = torch.from_numpy(on).to(dev)
            for _ in range(codec.q):  # q directions on this batch (n-SPSA)
                seeds = [0] * c
                for i in active:
                    seeds[i] = (pool.sample(picks[i]) if pool is not None
                                else encoders[i].next_seed())
                z = prng.rademacher_rows(seeds, size, device=dev)
                z *= on_t  # an inactive client does not move
                theta.add_(z, alpha=eps)                     # theta + eps z
                plus_t = loss_of(theta, xb, yb, mb)
                theta.add_(z, alpha=-2 * eps)                # theta - eps z
                minus_t = loss_of(theta, xb, yb, mb)
                # one host synchronisation per direction: every client's two losses together
                both = torch.stack((plus_t, minus_t)).double().cpu().numpy()
                coeff[:] = 0.0
                for i in active:
                    plus, minus = float(both[0, i]), float(both[1, i])
                    g = (plus - minus) / (2 * eps)
                    if math.isfinite(g):
                        step = encoders[i].record(seed=seeds[i], g=g / codec.q, lr=settings.lr)
                        coeff[i] = np.float32(eps + float(step))
                        loss_sum[i] += 0.5 * (plus + minus)
                        g_abs[i] += abs(g)
                        kept[i] += 1
                    else:
                        coeff[i] = eps           # back to theta, up to rounding
                        skipped[i] += 1
                theta.addcmul_(z, torch.from_numpy(coeff).to(dev))
    out = ex.to_host(theta)
    zeros = np.broadcast_to(np.float32(0), (size,))
    active_steps = plan.active.sum(axis=1).tolist()
    results = []
    for i, enc in enumerate(encoders):
        metrics = {"train_loss": loss_sum[i] / max(kept[i], 1),
                   "steps": float(active_steps[i]),
                   "zo_g_abs": g_abs[i] / max(kept[i], 1)}
        if skipped[i]:  # the trainer reports the exceptional ones only when they occur
            metrics["zo_skipped"] = float(skipped[i])
        if enc.clipped:
            metrics["zo_clipped"] = float(enc.clipped)
        results.append(JobResult(out[i], plan.sizes[i], metrics,
                                 encoded=(SEED_CODEC, enc.encode(zeros))))
    return results


LossOfRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _losses(ex: VectorisedExecutor) -> LossOfRows:
    """``loss(theta, x, y, mask)``: every client's mean loss on its batch at its row of
    ``theta``, from one vmapped forward pass of an ``eval()`` copy of the template."""
    module: nn.Module = copy.deepcopy(ex.module).eval()
    names = list(ex.offsets)
    shapes = {n: ex.tensor_spec[n].shape for n in names}
    spans = {n: (off, off + ex.tensor_spec[n].numel) for n, off in ex.offsets.items()}
    local = dict(ex.local_state)

    def one(row: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
        tensors = {n: row[spans[n][0]:spans[n][1]].view(shapes[n]) for n in names}
        tensors.update(local)
        per = ex.loss(functional_call(module, tensors, (x,)), y)
        return (per * mask).sum() / mask.sum().clamp(min=1.0)

    return vmap(one)  # type: ignore[no-any-return]
