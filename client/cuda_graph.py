"""CUDA graphs for :class:`~murmura.client.torch_trainer.TorchTrainer` (``cuda_graph=True``):
a task's whole training step captured once and replayed for every whole batch, one launch
per step instead of dozens.

When a capture pays (:func:`full_batches` against :data:`GRAPH_WARMUP` and
:data:`GRAPH_MIN_REPLAYS`) and the captured step itself (:class:`_GraphedStep`) live here,
apart from the trainer's eager path: they touch CUDA streams and graph memory pools, which
only this optional path needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from murmura.protocols import TaskSettings

if TYPE_CHECKING:
    from murmura.client.torch_trainer import TorchTrainer

#: Eager steps a task takes before its step is captured in a CUDA graph (the first one creates
#: the momentum buffers the graph then updates in place).
GRAPH_WARMUP = 2
#: Fewest replays of the captured step that make a capture (about one eager step's launches,
#: plus instantiation) worth it; tasks with fewer full batches run eagerly.
GRAPH_MIN_REPLAYS = 16


def full_batches(n: int, settings: TaskSettings) -> int:
    """How many of a task's steps on ``n`` array examples see a whole ``batch_size`` batch
    (the rest are the short last batches of epochs)."""
    b = settings.batch_size
    per_epoch, full = -(-n // b), n // b
    if per_epoch == 0:
        return 0
    total = settings.local_steps or settings.local_epochs * per_epoch
    return (total // per_epoch) * full + min(total % per_epoch, full)


class _GraphedStep:
    """A task's training step captured in a CUDA graph after ``GRAPH_WARMUP`` eager steps,
    then replayed on static copies of each whole batch.

    The eager warm-up steps and the capture run on a side stream (as torch's whole-network
    capture recipe does). The captured step updates the model's parameters and the
    optimizer's momentum buffers in place, so eager steps (a short last batch) and replays mix
    freely within the task. The step is captured without autocast's weight cache.
    """

    def __init__(self, trainer: TorchTrainer, opt: torch.optim.Optimizer,
                 weights: Sequence[torch.Tensor], amp: torch.dtype | None,
                 scaler: torch.amp.GradScaler, stream: torch.cuda.Stream) -> None:
        self.trainer, self.opt, self.weights = trainer, opt, weights
        self.amp, self.scaler, self.stream = amp, scaler, stream
        self.warm = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.grads: list[torch.Tensor | None] = []

    def _on_side_stream(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        main = torch.cuda.current_stream(self.trainer.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            out = fn()
        main.wait_stream(self.stream)
        return out

    def _capture(self, x: torch.Tensor, y: torch.Tensor) -> None:
        static_x, static_y = x.clone(), y.clone()
        self.x, self.y = static_x, static_y
        graph = torch.cuda.CUDAGraph()

        def capture() -> torch.Tensor:
            graph.capture_begin()
            try:
                loss = self.trainer._step(static_x, static_y, self.opt, self.weights, self.amp,
                                          self.scaler, cache=False)
            except BaseException:
                with contextlib.suppress(Exception):
                    graph.capture_end()
                raise
            graph.capture_end()
            return loss

        try:
            self.loss = self._on_side_stream(capture)
        except Exception as exc:
            raise RuntimeError(
                "cuda_graph=True: this model's training step could not be captured in a CUDA "
                "graph (it needs static shapes and no host synchronisation); train without "
                f"cuda_graph: {exc}") from exc
        self.grads = [p.grad for p in self.weights]  # keep the captured gradients alive
        self.graph = graph

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            if self.warm < GRAPH_WARMUP:
                self.warm += 1
                return self._on_side_stream(lambda: self.trainer._step(
                    x, y, self.opt, self.weights, self.amp, self.scaler))
            self._capture(x, y)
        assert self.graph is not None and self.x is not None and self.y is not None
        self.x.copy_(x)
        self.y.copy_(y)
        self.graph.replay()
        assert self.loss is not None
        return self.loss
