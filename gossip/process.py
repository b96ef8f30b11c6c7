"""A peer process for the bundled tasks: what ``murmura peer`` and ``murmura run --gossip`` run.

Every peer builds the same starting model (the task's model initialised from the run seed),
trains on its share of the task's data, and, with a report directory, writes one JSON row per
round (test accuracy of its own model, bytes sent) and its model after the round, from which
``murmura run --gossip`` computes the mean, min, max and consensus distance.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from murmura.client import RetryPolicy, TorchTrainer, ZOTrainer
from murmura.client.malicious import make_attack
from murmura.gossip.config import GossipConfig, PeerConfig
from murmura.gossip.runtime import PeerRuntime, PeerStats, RoundReport
from murmura.gossip.transport import GrpcPeerTransport
from murmura.protocols.identity import NodeKey
from murmura.tasks import TaskConfig, load_task
from murmura.tasks.models import evaluate

log = logging.getLogger(__name__)

__all__ = ["build_peer", "run_peer"]


def build_peer(cfg: PeerConfig, task_cfg: TaskConfig, gossip: GossipConfig, *,
               transport: GrpcPeerTransport | None = None,
               on_metrics: Callable[[int, dict[str, Any]], None] | None = None) -> PeerRuntime:
    """A :class:`PeerRuntime` for the bundled task's share ``cfg.client_index``; each round's
    model is evaluated on the test set when ``cfg.report`` or ``on_metrics`` wants it
    (``on_metrics(round, metrics)``: ``murmura peer``'s line per round)."""
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    task = load_task(task_cfg)
    attack = make_attack(cfg.attack, cfg.attack_options, seed=cfg.client_index)
    data = task.client_data(cfg.client_index, cfg.num_clients)
    if attack.data is not None:
        data = attack.data(data)
    model = task.build_model(seed=gossip.seed)  # every peer starts from the same model
    trainer: TorchTrainer | ZOTrainer = (ZOTrainer(model, data, device=cfg.device)
                                         if gossip.seed_mode
                                         else TorchTrainer(model, data, device=cfg.device))
    start = trainer.spec.flatten(trainer.model)
    eval_model = task.build_model(seed=gossip.seed)
    report = Path(cfg.report) if cfg.report else None
    on_round = None
    if report is not None:
        report.mkdir(parents=True, exist_ok=True)
        rows = (report / f"{cfg.identity()}.jsonl").open("a", encoding="utf-8")
    lock = threading.Lock()
    if report is not None or on_metrics is not None:

        def on_round(r: RoundReport) -> None:
            trainer.spec.load_into(eval_model, r.model)
            metrics = evaluate(eval_model, task.test)
            if on_metrics is not None:
                on_metrics(r.round, {**metrics, "mixed": r.mixed, "view": r.view})
            if report is None:
                return
            np.save(report / f"{cfg.identity()}-r{r.round:05d}.npy", r.model)
            row: dict[str, Any] = {"peer": cfg.identity(), "round": r.round,
                                   "accuracy": metrics.get("accuracy"),
                                   "loss": metrics.get("loss"), "mixed": r.mixed,
                                   "view": r.view, "bytes_sent": r.bytes_sent,
                                   "time_s": r.time_s}
            with lock:
                rows.write(json.dumps(row) + "\n")
                rows.flush()

    return PeerRuntime(transport or GrpcPeerTransport(cfg.listen), trainer,
                       peer_id=cfg.identity(), config=gossip, bootstrap=cfg.bootstrap_list(),
                       model=start, catch_up=cfg.catch_up, on_round=on_round,
                       num_peers=cfg.num_clients,
                       update_hook=attack.update,
                       key=None if cfg.unsigned else (NodeKey.load(cfg.key) if cfg.key
                                                      else NodeKey.generate()),
                       retry=RetryPolicy(initial_s=0.05, max_s=1.0, give_up_after_s=60.0))


def run_peer(cfg: PeerConfig, task_cfg: TaskConfig, gossip: GossipConfig,
             *, started: threading.Event | None = None,
             stop: threading.Event | None = None) -> tuple[PeerRuntime, PeerStats]:
    """Build, start (announcing the bound address on stdout) and run one peer."""
    runtime = build_peer(cfg, task_cfg, gossip)
    address = runtime.start()
    print(f"murmura peer {cfg.identity()} listening on {address}", flush=True)
    if started is not None:
        started.set()
    if stop is not None:
        def stop_when_set(event: threading.Event) -> None:
            event.wait()
            runtime.stop()
        threading.Thread(target=stop_when_set, args=(stop,), daemon=True).start()
    stats = runtime.run()
    return runtime, stats


def peer_process(cfg: PeerConfig, task_cfg: TaskConfig, gossip: GossipConfig,
                 events: Any = None, log_path: str = "") -> None:
    """Entry point of a peer child process (``murmura run --gossip``, tests).

    Puts ``("started", peer_id, address)`` and, at the end, ``("done", peer_id, stats, model,
    first_round)`` on ``events`` when given; SIGTERM is a graceful leave.
    """
    import os
    import signal
    import sys
    from dataclasses import asdict

    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runtime = build_peer(cfg, task_cfg, gossip)
    signal.signal(signal.SIGTERM, lambda *_: runtime.stop())
    address = runtime.start()
    first_round = runtime.node.round
    print(f"murmura peer {cfg.identity()} listening on {address}", flush=True)
    if events is not None:
        events.put(("started", cfg.identity(), address))
    stats = runtime.run()
    print(f"peer {cfg.identity()}: {stats.rounds} rounds, {stats.sent} sent, "
          f"{stats.received} received, {stats.send_failures} failed sends", flush=True)
    if events is not None:
        events.put(("done", cfg.identity(), asdict(stats), runtime.node.model, first_round))
