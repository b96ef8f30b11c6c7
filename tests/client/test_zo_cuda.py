"""The zeroth-order trainer on a CUDA device, eager and with its loss replayed as a CUDA graph.

Skipped without a GPU (CI has none); ``-m gpu`` selects them on a GPU machine. No conftest
fixtures: the device script runs these with ``--noconftest``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from murmura.client.zo import ZOTrainer
from murmura.protocols import TaskSettings, create_codec
from murmura.protocols.codecs.seed import SeedCodec, replay
from murmura.tasks import ArrayDataset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU")]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))


def data(n: int = 100) -> ArrayDataset:
    rng = np.random.default_rng(1)
    return ArrayDataset(rng.normal(size=(n, 32)).astype(np.float32),
                        rng.integers(0, 10, n).astype(np.int64))


SETTINGS = TaskSettings(trainer="zo", codec="seed", local_epochs=2, local_steps=0,
                        batch_size=32, lr=1e-2, zo_eps=1e-3)


def train(graph: bool, loss_fn=nn.functional.cross_entropy):  # noqa: ANN001, ANN201
    trainer = ZOTrainer(model(), data(), device="cuda", cuda_graph=graph, loss_fn=loss_fn)
    start = trainer.spec.flatten(trainer.model)
    return trainer, start, trainer.train(start, SETTINGS, seed=5)


@pytest.mark.parametrize("graph", [False, True])
def test_the_server_replays_a_cuda_client_exactly(graph: bool) -> None:
    # 100 examples in batches of 32: three full batches and a short one per epoch, so the
    # graphed trainer captures two shapes
    trainer, start, result = train(graph)
    codec = create_codec("seed")
    assert isinstance(codec, SeedCodec) and result.encoded is not None
    steps = codec.unpack(result.encoded[1])
    assert len(steps.seeds) == 8 and result.metrics["steps"] == 8
    assert result.params is not None
    assert replay(start, steps).tobytes() == result.params.tobytes()  # the CPU replay
    if graph:
        assert trainer._graphs is not None and len(trainer._graphs.graphs) == 2


def test_graphed_and_eager_losses_agree() -> None:
    *_, eager = train(False)
    *_, graphed = train(True)
    codec = create_codec("seed")
    assert isinstance(codec, SeedCodec)
    a, b = codec.unpack(eager.encoded[1]), codec.unpack(graphed.encoded[1])  # type: ignore[index]
    np.testing.assert_array_equal(a.seeds, b.seeds)
    np.testing.assert_allclose(a.grads, b.grads, rtol=1e-3, atol=1e-4)
    assert eager.metrics["train_loss"] == pytest.approx(graphed.metrics["train_loss"], rel=1e-4)


def test_a_loss_that_reads_the_host_trains_eagerly_after_one_warning(caplog) -> None:
    def reads_the_host(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(logits, y)
        return loss * 2 if float(loss) > 1e30 else loss  # a host read: not capturable

    with caplog.at_level(logging.WARNING, logger="murmura.client.zo"):
        trainer, start, result = train(True, loss_fn=reads_the_host)
    assert [r for r in caplog.records if "could not be captured" in r.getMessage()]
    assert trainer._graphs is not None and trainer._graphs.failed
    codec = create_codec("seed")
    assert isinstance(codec, SeedCodec) and result.params is not None
    assert replay(start, codec.unpack(result.encoded[1])).tobytes() == \
        result.params.tobytes()  # type: ignore[index]
