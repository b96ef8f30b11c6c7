"""``murmura new NAME``: write a starting app file that runs as it is (docs/apps.md)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")

TEMPLATE = '''"""{name}: a Murmura app, your model and your data in one file (docs/apps.md).

Run it:   murmura run --app {name}.py --clients 4 --max-versions 10 --in-process
Serve it: murmura server --app {name}.py  and, on each client machine,
          murmura client --app {name}.py --server HOST:PORT --client-index I --num-clients N
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

FEATURES, CLASSES = 16, 4


def model() -> nn.Module:
    """A fresh model; every client and the server build the same architecture."""
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def _make(num_examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Noisy class clusters; replace with reading your own files."""
    centres = np.random.default_rng(0).normal(0, 1, (CLASSES, FEATURES))
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, num_examples)
    x = centres[y] + rng.normal(0, 1.5, (num_examples, FEATURES))
    return x.astype(np.float32), y.astype(np.int64)


def client_data(index: int, num_clients: int) -> tuple[np.ndarray, np.ndarray]:
    """Client ``index``'s own training data (x, y); here each client draws its own."""
    return _make(300, seed=1000 + index)


def test_data() -> tuple[np.ndarray, np.ndarray]:
    """The server's evaluation data (optional: without it the server reports no accuracy)."""
    return _make(1000, seed=1)


# Optional: your own local training. Without it Murmura runs SGD with the server's settings
# (--lr, --local-epochs, --batch-size, --momentum) and cross-entropy (or your loss()).
def train(model: nn.Module, data: tuple[np.ndarray, np.ndarray], settings, seed: int) -> dict:
    x, y = torch.from_numpy(data[0]), torch.from_numpy(data[1])
    opt = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=settings.momentum)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(settings.local_epochs):
        order = torch.randperm(len(y), generator=gen)
        for start in range(0, len(y), settings.batch_size):
            rows = order[start:start + settings.batch_size]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            opt.step()
    return {{"num_examples": len(y)}}  # required: the update's weight in the mean


# Optional: evaluate(model, data) -> dict of metrics (default: accuracy and loss), used by
# the server on test_data() and by clients with --client-eval-every N.
#
# Optional: an aggregation rule selectable with --defense NAME:
#
#   from murmura.aggregation import WeightedMean, aggregation_rule
#
#   @aggregation_rule("{name}-mean")
#   def my_rule(size: int, **options: str) -> WeightedMean:
#       return WeightedMean(size)
'''


def scaffold(name: str, directory: str | Path = ".", *, force: bool = False) -> Path:
    """Write ``directory/NAME.py`` from the template; refuses to overwrite unless ``force``."""
    stem = name[:-3] if name.endswith(".py") else name
    if not NAME.match(stem):
        raise ValueError(f"app name must be letters, digits, _ or - (starting with a letter "
                         f"or _), got {name[:40]!r}")
    path = Path(directory) / f"{stem}.py"
    if path.exists() and not force:
        raise ValueError(f"{path} already exists (give --force to overwrite it)")
    path.write_text(TEMPLATE.format(name=stem), encoding="utf-8")
    return path


def cmd_new(args: argparse.Namespace) -> int:
    path = scaffold(args.name, args.dir, force=args.force)
    print(f"wrote {path}; run it with: murmura run --app {path} --in-process")
    return 0


__all__ = ["TEMPLATE", "cmd_new", "scaffold"]
