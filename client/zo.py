"""Seed-based zeroth-order local training (MeZO steps sent as FedKSeed-style step logs).

Implementation based on MeZO, Malladi et al., "Fine-Tuning Language Models with Just Forward
Passes", https://arxiv.org/abs/2305.17333, and FedKSeed, Qin et al., "Federated Full-Parameter
Tuning of Billion-Sized Language Models with Communication Cost under 18 Kilobytes",
https://arxiv.org/abs/2312.06353.

Each local step draws a seed, measures the loss of one batch at ``theta + eps z`` and
``theta - eps z`` (``z`` the seed's Rademacher direction, forward passes only, no autograd
graph) and takes ``theta <- theta - lr * g * z`` with the projected gradient
``g = (L+ - L-) / (2 eps)``. The update that goes to the server is the list of ``(seed, g)``
pairs (codec ``seed``), a few bytes per step whatever the model size; the server replays it on
the version the client started from.

Memory. The module's floating state is re-pointed at one flat float32 vector ``theta`` (one copy
of the model, as for inference), and the perturbations are applied to ``theta`` in place, as
MeZO does: ``+eps z``, ``-2 eps z``, ``+eps z``. Apart from the activations of one forward pass
(freed before the next), the only temporaries are one block of ``z`` (1 MiB). Exactness. In
floating point ``theta + eps z - 2 eps z + eps z`` is not ``theta``: the in-place perturbation
leaves rounding drift of an ulp or so per coordinate and step. It only affects where ``g`` is
measured; the committed steps are the recorded ``(seed, g_wire)`` pairs, and at the end of a
task the trainer rebuilds ``theta`` from the starting vector by replaying them with the
codec's own arithmetic. The returned model is then the server's replay, bit for bit. With
``return_params=False`` (the client runtime: it sends the log and never reads the model back)
the rebuild is skipped and the module holds the trained model up to that drift.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from murmura.client.torch_trainer import TorchTrainer
from murmura.client.trainer import (
    LossFn,
    Trainer,
    TrainResult,
    count_examples,
    iter_batches,
)
from murmura.edge import resolve_device
from murmura.protocols import FlatVector, ModelSpec, TaskSettings, create_codec, prng
from murmura.protocols.codecs.seed import APPLY_BLOCK, SeedCodec, apply_step, apply_steps
from murmura.tasks import ArrayDataset

log = logging.getLogger(__name__)

#: The codec a zeroth-order update always travels in.
SEED_CODEC = "seed"


def seed_codec_for(settings: TaskSettings) -> SeedCodec:
    """The ``seed`` codec exactly as the server will build it to decode this client's pushes.

    The server applies ``settings.codec_options`` only to pushes whose codec is
    ``settings.codec``. So when the server's codec is ``seed`` its options are used; otherwise
    (a misconfiguration: ``trainer = "zo"`` with, say, ``codec = "int8"``) the update still goes
    out as ``seed`` with default options, which is what the server decodes it with.
    """
    options = settings.codec_options if settings.codec == SEED_CODEC else {}
    codec = create_codec(SEED_CODEC, options)
    assert isinstance(codec, SeedCodec)
    return codec


def check_step_budget(planned: int | None, codec: SeedCodec) -> None:
    """Refuse a task whose steps (``planned``, None when unknown) cannot fit one payload."""
    if planned is not None and planned * codec.q > codec.max_steps:
        raise ValueError(f"{planned} zeroth-order steps per task x q={codec.q} perturbations "
                         f"exceed the seed codec's max_steps={codec.max_steps}; lower "
                         "local_steps/local_epochs or q, or raise codec option max_steps on "
                         "the server")


def model_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def check_fits(nbytes: int, device: torch.device, free_bytes: int) -> None:
    """Refuse (ValueError, one line) a model that cannot be trained zeroth-order on ``device``:
    binding it to one flat vector holds it twice for a moment, and the forward passes need
    room for activations (a tenth of the free memory is kept for them)."""
    if 2 * nbytes > 0.9 * free_bytes:
        raise ValueError(f"the model ({nbytes / 1e9:.2f} GB) does not fit on {device} for "
                         f"zeroth-order training: {free_bytes / 1e9:.2f} GB free, about "
                         f"{2 * nbytes / 0.9e9:.2f} GB needed; use a smaller model or another "
                         f"device (--device cpu)")


def bind_flat(module: nn.Module, spec: ModelSpec, device: torch.device) -> torch.Tensor:
    """Re-point every floating tensor of ``module`` at a slice of one new flat float32 vector.

    Returns the vector. Afterwards writing into it changes the module, with no extra copy of the
    model kept. The old storage is freed tensor by tensor as it is replaced. Tied tensors (two
    spec entries sharing storage) and non-float32 tensors are refused, since a flat float32 view
    cannot represent them.
    """
    state = module.state_dict(keep_vars=True)
    seen: dict[int, str] = {}
    for t in spec.tensors:
        value = state[t.name]
        if value.dtype != torch.float32:
            raise ValueError(f"zeroth-order training needs float32 tensors; {t.name!r} is "
                             f"{value.dtype}")
        ptr = value.data_ptr()
        if value.numel() and ptr in seen:
            raise ValueError(f"tensors {seen[ptr]!r} and {t.name!r} share storage (tied "
                             "weights); zeroth-order training does not support that")
        seen[ptr] = t.name
    theta = torch.empty(spec.size, dtype=torch.float32, device=device)
    with torch.no_grad():
        for t, off in zip(spec.tensors, spec.offsets(), strict=True):
            view = theta[off : off + t.numel].view(t.shape)
            value = state[t.name]
            view.copy_(value.detach())
            owner_name, _, attr = t.name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            if isinstance(value, nn.Parameter):
                value.data = view
            else:
                owner._buffers[attr] = view
    return theta


def _perturber(theta: torch.Tensor, seed: int) -> Callable[[float], None]:
    """``perturb(c)`` adds ``c * z(seed)`` to theta in place.

    On a CPU, a model no larger than one block keeps its ``z`` for the three perturbations of a
    step (no bigger than the block ``apply_step`` would allocate anyway); a larger one
    regenerates ``z`` block by block each time, so no model-sized temporary ever exists. On
    CUDA every perturbation is one fused kernel pass that draws ``z`` in registers.
    """
    if theta.numel() > APPLY_BLOCK or theta.device.type == "cuda":
        # on CUDA each perturbation is one fused pass (protocols/codecs/seed_triton.py)
        return lambda coeff: apply_step(theta, seed, coeff)
    z = prng.rademacher(seed, theta.numel(), device=theta.device)

    def perturb(coeff: float) -> None:
        theta.add_(z, alpha=coeff)

    return perturb


#: Batch shapes a trainer captures a loss graph for (a task's full batches and its short last
#: one); other shapes run eagerly.
MAX_LOSS_GRAPHS = 2
#: Eager passes on the capture stream before a capture (lazy cuBLAS and allocator set-up).
LOSS_GRAPH_WARMUP = 2


class _LossGraphs:
    """``loss_fn(model(x), y)`` captured once per batch shape as a CUDA graph and replayed.

    A zeroth-order step on a small model is bound by kernel launches, not by arithmetic: two
    forward passes of a 9.7 M-parameter MLP are a dozen small kernels each, and the fused
    perturbations are three more. Replaying the forward and the loss as one graph launch
    leaves about eight launches per step. The graph reads ``theta`` where the perturbations
    write it (the module's tensors are views of it), so a replay sees the perturbed model.
    The batch is copied into the graph's static inputs once per batch, for all its directions.
    A model whose forward cannot be captured (a host synchronisation, data-dependent Python
    control flow) is trained eagerly after one warning.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, device: torch.device) -> None:
        self.model, self.loss_fn, self.device = model, loss_fn, device
        self.stream: torch.cuda.Stream | None = None
        self.graphs: dict[tuple[Any, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor,
                                                 torch.Tensor, torch.Tensor]] = {}
        self.failed = False

    def bind(self, x: torch.Tensor, y: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        """A function returning this batch's loss at the current ``theta`` (None: run it
        eagerly)."""
        if self.failed:
            return None
        key = (tuple(x.shape), x.dtype, tuple(y.shape), y.dtype)
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= MAX_LOSS_GRAPHS:
                return None
            entry = self._capture(x, y)
            if entry is None:
                return None
            self.graphs[key] = entry
        graph, static_x, static_y, out = entry
        static_x.copy_(x)
        static_y.copy_(y)

        def loss() -> torch.Tensor:
            graph.replay()
            return out.clone()  # the next replay overwrites ``out``
        return loss

    def _capture(self, x: torch.Tensor, y: torch.Tensor
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor,
                            torch.Tensor] | None:
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        static_x, static_y = x.clone(), y.clone()
        graph = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream(self.device)
        try:
            self.stream.wait_stream(main)
            with torch.cuda.stream(self.stream):
                for _ in range(LOSS_GRAPH_WARMUP):
                    self.loss_fn(self.model(static_x), static_y)
            main.wait_stream(self.stream)
            with torch.cuda.graph(graph, stream=self.stream):
                out = self.loss_fn(self.model(static_x), static_y)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: train eagerly
            self.failed = True
            torch.cuda.synchronize(self.device)
            log.warning("cuda_graph: this model's loss could not be captured in a CUDA graph "
                        "(%s); training eagerly", exc)
            return None
        return graph, static_x, static_y, out


class ZOTrainer(Trainer):
    """Zeroth-order local training that sends ``(seed, g)`` step logs instead of the model.

    Takes the same ``model``, ``data``, ``loss_fn``, ``device`` and ``num_examples`` as
    :class:`~murmura.client.TorchTrainer`. Uses ``settings.lr``, ``settings.zo_eps``,
    ``settings.batch_size`` and ``settings.local_steps`` (or ``local_epochs`` passes over the
    data when ``local_steps`` is 0); momentum and weight decay do not exist in a step log.

    The loss is measured with the module in ``eval()`` mode, so a forward pass is a pure
    function of ``theta`` (no dropout mask, no BatchNorm statistics update). BatchNorm running
    statistics are part of the flat vector and are moved by the steps like any other value.

    ``train`` returns ``encoded = ("seed", payload)`` and, if ``return_params`` (default), a
    copy of the new model; the client runtime only needs the payload, so pass
    ``return_params=False`` there to keep the peak at one copy of the model and skip the exact
    rebuild (the module is then the trained model up to an ulp of drift per step).
    The construction re-points ``model``'s tensors at one flat vector (see :func:`bind_flat`).
    ``cuda_graph=True`` (CUDA only) replays each batch's forward pass and loss as a CUDA graph:
    fewer kernel launches per step, the same arithmetic (see :class:`_LossGraphs`).
    """

    def __init__(self, model: nn.Module, data: ArrayDataset | Iterable[Any] | Callable[[], Any],
                 *, loss_fn: LossFn = nn.functional.cross_entropy, device: str = "auto",
                 num_examples: int | None = None, return_params: bool = True,
                 cuda_graph: bool = False) -> None:
        self.device = resolve_device(device)
        if self.device.type == "cuda":  # refuse in one line, not with an allocator trace
            free, _ = torch.cuda.mem_get_info(self.device)
            check_fits(model_bytes(model), self.device, free)
        self.model = model.to(self.device)
        self.spec = ModelSpec.from_module(self.model)
        self.theta = bind_flat(self.model, self.spec, self.device)
        self.data = data
        self.loss_fn = loss_fn
        self.return_params = return_params
        self._num_examples = num_examples
        self._warned_codec = False
        #: CUDA: replay each batch's forward pass and loss as a CUDA graph (see _LossGraphs)
        self.cuda_graph = cuda_graph
        self._graphs: _LossGraphs | None = None

    def _loss_of(self, x: torch.Tensor, y: torch.Tensor) -> Callable[[], torch.Tensor]:
        """This batch's loss at the current ``theta``, as a function (graphed when asked)."""
        if self.cuda_graph and self.device.type == "cuda":
            if self._graphs is None:
                self._graphs = _LossGraphs(self.model, self.loss_fn, self.device)
            graphed = self._graphs.bind(x, y)
            if graphed is not None:
                return graphed
        return lambda: self.loss_fn(self.model(x), y)

    def num_examples(self) -> int:
        return count_examples(self.data, self._num_examples)

    def planned_steps(self, settings: TaskSettings) -> int | None:
        """Steps one task takes, when known in advance (local_steps, or epochs of arrays)."""
        if settings.local_steps:
            return settings.local_steps
        if isinstance(self.data, ArrayDataset):
            return settings.local_epochs * math.ceil(len(self.data) / settings.batch_size)
        return None

    def _codec(self, settings: TaskSettings) -> SeedCodec:
        if settings.codec != SEED_CODEC and not self._warned_codec:
            log.warning("trainer 'zo' with codec %r: sending seed-based updates (codec 'seed', "
                        "default options) instead", settings.codec)
            self._warned_codec = True
        codec = seed_codec_for(settings)
        check_step_budget(self.planned_steps(settings), codec)
        return codec

    def train(self, params: FlatVector, settings: TaskSettings, *, seed: int) -> TrainResult:
        self.spec.check_vector(params)
        codec = self._codec(settings)
        encoder = codec.encoder(self.spec.size, seed=seed)
        # FedKSeed: with a shared pool, every step seed is one of the pool's K seeds.
        pool = codec.pool(settings.seed)
        next_seed = encoder.next_seed
        if pool is not None:
            pick = np.random.default_rng(seed)
            next_seed = lambda: pool.sample(pick)  # noqa: E731
        gen = torch.Generator().manual_seed(seed % (2**63))
        theta = self.theta
        start = torch.from_numpy(np.ascontiguousarray(params, dtype=np.float32))
        theta.copy_(start)
        eps = float(np.float32(settings.zo_eps))
        self.model.eval()
        limit = settings.local_steps or None
        epochs = settings.local_epochs if not limit else 10**9
        steps = skipped = 0
        loss_sum = g_abs = 0.0
        with torch.no_grad():
            for _ in range(epochs):
                before = steps
                for x, y in iter_batches(self.data, settings.batch_size, gen):
                    x, y = x.to(self.device), y.to(self.device)
                    loss_at_theta = self._loss_of(x, y)
                    steps += 1
                    for _ in range(codec.q):  # q directions on this batch (n-SPSA)
                        step_seed = next_seed()
                        perturb = _perturber(theta, step_seed)
                        perturb(eps)                    # theta + eps z
                        plus_t = loss_at_theta()
                        perturb(-2 * eps)               # theta - eps z
                        minus_t = loss_at_theta()
                        # one host synchronisation per direction: both losses read together
                        plus, minus = torch.stack((plus_t, minus_t)).double().tolist()
                        g = (plus - minus) / (2 * eps)
                        if math.isfinite(g):
                            # back to theta and the step in one pass: theta + (eps + c) z. Up
                            # to rounding, as the restore alone would be; the model is rebuilt
                            # exactly from the log below.
                            coeff = encoder.record(seed=step_seed, g=g / codec.q,
                                                   lr=settings.lr)
                            perturb(float(np.float32(eps + float(coeff))))
                            loss_sum += 0.5 * (plus + minus)
                            g_abs += abs(g)
                        else:
                            perturb(eps)                # back to theta, up to rounding
                            skipped += 1
                    if limit and steps >= limit:
                        break
                if (limit and steps >= limit) or steps == before:  # done, or no data at all
                    break
        if steps == 0:
            raise ValueError("the local data yielded no batch")
        if self.return_params:
            # The exact model: the starting vector plus the recorded steps, as the server
            # replays it. Only a caller that reads the model needs it: the client runtime
            # sends the log and starts its next task from the server's vector, so it skips
            # this replay (a whole task's worth of draws: about 15 % of a 10-step task).
            log_ = encoder.steps()
            theta.copy_(start)
            apply_steps(theta, log_.seeds, log_.coefficients)
        clipped = encoder.clipped
        payload = encoder.encode(np.broadcast_to(np.float32(0), (self.spec.size,)))
        kept = steps * codec.q - skipped  # directions whose estimate was finite
        metrics = {"train_loss": loss_sum / max(kept, 1), "steps": float(steps),
                   "zo_g_abs": g_abs / max(kept, 1)}
        # Metrics travel in the update header: only report the exceptional ones when they occur.
        if skipped:
            metrics["zo_skipped"] = float(skipped)
        if clipped:
            metrics["zo_clipped"] = float(clipped)
        new = theta.detach().to("cpu", copy=True).numpy() if self.return_params else None
        return TrainResult(new, self.num_examples(), metrics, encoded=(SEED_CODEC, payload))


class SettingsTrainer(Trainer):
    """First-order SGD or seed-based zeroth-order training, as ``settings.trainer`` says.

    The client learns the server's settings only when it joins, so a client built before that
    holds both trainers over one module and one data share and picks per task:
    ``"sgd"`` → :class:`~murmura.client.TorchTrainer`, ``"zo"`` → :class:`ZOTrainer`.
    """

    def __init__(self, model: nn.Module, data: ArrayDataset | Iterable[Any] | Callable[[], Any],
                 *, loss_fn: LossFn = nn.functional.cross_entropy, device: str = "auto",
                 num_examples: int | None = None, amp: str = "auto") -> None:
        self.zeroth_order = ZOTrainer(model, data, loss_fn=loss_fn, device=device,
                                      num_examples=num_examples, return_params=False)
        self.first_order = TorchTrainer(self.zeroth_order.model, data, loss_fn=loss_fn,
                                        device=str(self.zeroth_order.device),
                                        num_examples=num_examples, amp=amp)
        self.model = self.zeroth_order.model
        self.device = self.zeroth_order.device
        self.spec = self.zeroth_order.spec
        #: set by :meth:`train_zeroth_order_only`: the step size of this client's
        #: zeroth-order steps when the server asks for first-order training
        self.zo_lr: float | None = None

    def train_zeroth_order_only(self, lr: float) -> None:
        """Train zeroth-order even when the server asks for SGD: for a device whose memory
        holds the model's forward pass but not one example's backward pass (``murmura client
        --trainer auto`` decides so from :func:`murmura.edge.probe_micro_batch`).

        Such a task runs the server's step budget (``local_steps``, or ``local_epochs`` over
        the data) of zeroth-order steps of size ``lr`` (SGD's ``lr`` would be far too large
        for two-point estimates) and returns the new model: the runtime encodes the update
        with the server's codec, so the server sees an ordinary update.
        """
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"the zeroth-order lr must be a positive number, got {lr}")
        self.zo_lr = lr

    def train(self, params: FlatVector, settings: TaskSettings, *, seed: int) -> TrainResult:
        if settings.trainer == "zo":
            return self.zeroth_order.train(params, settings, seed=seed)
        if self.zo_lr is None:
            return self.first_order.train(params, settings, seed=seed)
        zo = replace(settings, trainer="zo", codec=SEED_CODEC, codec_options={},
                     lr=self.zo_lr, momentum=0.0)
        self.zeroth_order.return_params = True
        try:
            result = self.zeroth_order.train(params, zo, seed=seed)
        finally:
            self.zeroth_order.return_params = False
        return TrainResult(result.params, result.num_examples,
                           {**result.metrics, "zo_fallback": 1.0})


def make_trainer(model: nn.Module, data: ArrayDataset | Iterable[Any] | Callable[[], Any], *,
                 loss_fn: LossFn = nn.functional.cross_entropy, device: str = "auto",
                 num_examples: int | None = None, amp: str = "auto") -> SettingsTrainer:
    """The trainer a client should run when it does not know the server's settings yet."""
    return SettingsTrainer(model, data, loss_fn=loss_fn, device=device,
                           num_examples=num_examples, amp=amp)


__all__ = ["SEED_CODEC", "SettingsTrainer", "ZOTrainer", "bind_flat", "check_step_budget",
           "make_trainer", "seed_codec_for"]
