"""Federated digits, written out: an aggregator and ten clients on loopback, in one script.

This is what ``murmura run`` does, with every piece visible: the task and its non-IID split,
the aggregator (sync rounds or FedBuff), and clients that train a small torch MLP on their own
share and push updates over real gRPC. Run it with::

    python examples/digits.py            # synchronous FedAvg
    python examples/digits.py --async    # buffered asynchronous aggregation (FedBuff)
"""

from __future__ import annotations

import argparse
import threading

import torch

from murmura.client import ClientRuntime, GrpcTransport, TorchTrainer
from murmura.protocols import TaskSettings
from murmura.server import ServerConfig, ServerThread, build_core
from murmura.tasks import TaskConfig, load_task

NUM_CLIENTS = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--async", dest="async_", action="store_true")
    parser.add_argument("--versions", type=int, default=30)
    parser.add_argument("--out", default="runs/example-digits")
    args = parser.parse_args()
    torch.set_num_threads(1)  # ten clients share this machine's cores

    # 1. The task: scikit-learn's bundled digits, split over clients by Dirichlet(0.5) labels.
    task_config = TaskConfig(task="digits", model="mlp", partition="dirichlet", alpha=0.5)
    task = load_task(task_config)

    # 2. The aggregator: what clients train and how their updates become global versions.
    server_config = ServerConfig.from_flat(
        mode="async" if args.async_ else "sync",
        max_versions=args.versions,
        min_clients=NUM_CLIENTS,     # sync: the first round waits for every client
        buffer_size=5,               # async: one version per 5 updates
        train=TaskSettings(lr=0.1, local_epochs=3, batch_size=16, momentum=0.5),
    )
    core = build_core(server_config, task_config, out_dir=args.out)

    with ServerThread(core, "127.0.0.1:0") as server:
        print(f"aggregator on {server.address}")

        # 3. Clients: each trains only on its own share and talks gRPC to the aggregator.
        def client(i: int) -> None:
            trainer = TorchTrainer(task.build_model(), task.client_data(i, NUM_CLIENTS),
                                   device="cpu")
            # each client makes an ephemeral identity key: its id derives from the key, it
            # proves the key when it joins and signs every update (docs/security.md)
            ClientRuntime(GrpcTransport(server.address), trainer).run()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(NUM_CLIENTS)]
        for t in threads:
            t.start()
        server.wait_done(timeout=600)
        for t in threads:
            t.join()
        final = server.call(lambda: dict(core.last_metrics))

    core.recorder.finish()
    print(f"version {final['version']}: test accuracy {final['accuracy']:.3f}, "
          f"{final['bytes_up'] / 1e6:.1f} MB uploaded; results in {args.out}/")


if __name__ == "__main__":
    main()
