"""A tiny Flower ClientApp for the strategy tests: linear regression in numpy.

Each node holds 64 rows of ``y = x @ W_TRUE + noise`` and runs a few gradient steps from the
global weights. The train config picks a scenario, so one simulation exercises several
strategies in turn (``tag`` keeps per-scenario node state apart):

* ``byzantine`` — nodes with partition-id < ``byzantine`` add 100 to every weight;
* ``sybils`` — nodes with partition-id < ``sybils`` are clones that all step towards
  ``-W_TRUE``; the honest nodes' data is non-IID (node k sees only the features of block
  k mod 3), so honest updates differ from each other while the clones' are identical;
* ``stale`` — the node with partition-id 0 keeps training from the first global model it got
  and reports that round as its ``trained-round``.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

DIM = 9
W_TRUE = np.linspace(-1.0, 1.0, DIM).astype(np.float32)

app = ClientApp()


def local_data(pid: int, noniid: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + pid)
    x = rng.normal(size=(64, DIM)).astype(np.float32)
    if noniid:  # only this node's block of three features
        mask = np.zeros(DIM, np.float32)
        mask[3 * (pid % 3) : 3 * (pid % 3) + 3] = 1.0
        x = x * mask
    y = x @ W_TRUE + 0.01 * rng.normal(size=64).astype(np.float32)
    return x, y


def gd(w: np.ndarray, x: np.ndarray, y: np.ndarray, steps: int = 5, lr: float = 0.2
       ) -> np.ndarray:
    for _ in range(steps):
        w = w - lr * (x.T @ (x @ w - y)) / len(y)
    return w.astype(np.float32)


@app.train()
def train(msg: Message, context: Context) -> Message:
    w = msg.content["arrays"].to_numpy_ndarrays()[0]
    config = msg.content["config"]
    pid = int(context.node_config["partition-id"])
    rnd = int(config["server-round"])
    tag = str(config.get("tag", ""))
    # every reply says which round's model it trained from (Flower's FedAvg wants the same
    # metric keys in every reply): fresh nodes echo the round they were sent
    metrics = {"num-examples": 64, "trained-round": rnd}
    if pid < int(config.get("byzantine", 0)):
        new = w + np.float32(100.0)
    elif pid < int(config.get("sybils", 0)):
        new = w + np.float32(0.5) * (-W_TRUE - w)
    elif int(config.get("stale", 0)) and pid == 0:
        key = f"first-{tag}"
        if key not in context.state:
            context.state[key] = ArrayRecord([w])
            context.state[f"round-{tag}"] = MetricRecord({"round": rnd})
        first = context.state[key].to_numpy_ndarrays()[0]
        x, y = local_data(pid, False)
        new = gd(first, x, y)
        metrics["trained-round"] = int(context.state[f"round-{tag}"]["round"])
    else:
        x, y = local_data(pid, bool(int(config.get("sybils", 0))))
        new = gd(w, x, y)
    return Message(RecordDict({"arrays": ArrayRecord([new]),
                               "metrics": MetricRecord(metrics)}), reply_to=msg)
