"""Assembling a client from its configuration: ``build_client``, beside ``server.build_core``.

``murmura client`` and any program that runs a client in-process (a test over the in-memory
transport, an embedded deployment) build it the same way here: the device, the task's share of
the data (and an opt-in red-team attack on it), the trainer the server's settings pick from
(first- or zeroth-order, or an app's own ``train``), the memory probe and speed profile on an
accelerator, evaluation on the client, and the runtime with its retry policy. The transport is
the caller's: gRPC for a deployment, in-memory for a test.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch

from murmura.client.app import task_trainer, with_client_eval
from murmura.client.config import ClientConfig
from murmura.client.malicious import make_attack
from murmura.client.retry import RetryPolicy
from murmura.client.runtime import ClientRuntime
from murmura.client.status import StatusTrainer
from murmura.client.transport import Transport
from murmura.client.zo import SettingsTrainer
from murmura.edge import device_profile, probe_micro_batch, profile_device, resolve_device
from murmura.protocols import PushResult
from murmura.protocols.identity import NodeKey
from murmura.tasks import ArrayDataset, Task, TaskConfig, load_task

log = logging.getLogger(__name__)

__all__ = ["build_client"]


def build_client(cfg: ClientConfig, task_cfg: TaskConfig, transport: Transport, *,
                 identity: NodeKey | None = None, task: Task | None = None) -> ClientRuntime:
    """A :class:`ClientRuntime` for ``cfg`` over ``transport``, training share
    ``cfg.client_index`` of ``task_cfg``'s data (``task``: an already loaded task).

    ``identity`` is the client's key (else ``cfg``'s key file, a fresh key, or its legacy
    client id, as ``cfg.node_key()`` says). Run it with ``runtime.run(max_tasks=...)``.
    """
    if identity is None:
        identity = cfg.node_key()  # before anything is loaded: a bad key file fails now
    device = resolve_device(cfg.device)
    if cfg.memory_fraction and device.type == "cuda":  # one of several clients on a GPU
        torch.cuda.set_per_process_memory_fraction(cfg.memory_fraction, device)
    task = task if task is not None else load_task(task_cfg)
    attack = make_attack(cfg.attack, cfg.attack_options, seed=cfg.client_index)
    data = task.client_data(cfg.client_index, cfg.num_clients)
    if attack.data is not None:
        data = attack.data(data)
    # The server's settings (sent at join) choose first- or zeroth-order training per task;
    # an app's own train function replaces both (client/app.py).
    trainer = task_trainer(task, data, device=str(device), amp=cfg.amp)
    profile = device_profile(device)
    if isinstance(trainer, SettingsTrainer) and isinstance(data, ArrayDataset) and len(data):
        micro = cfg.micro_batch
        if not micro and device.type == "cuda":  # the most rows that fit the cap
            try:
                micro = probe_micro_batch(trainer.model, torch.from_numpy(data.x[:16]),
                                          torch.from_numpy(data.y[:16]), device=device)
            except ValueError as exc:  # not one example's backward pass fits
                if cfg.trainer != "auto":
                    raise
                log.warning("%s: training zeroth-order (lr %g) whatever the server asks",
                            exc, cfg.zo_lr)
                trainer.train_zeroth_order_only(cfg.zo_lr)
        trainer.first_order.micro_batch = micro
        trainer.first_order.cuda_graph = cfg.cuda_graph
        trainer.zeroth_order.cuda_graph = cfg.cuda_graph
        if cfg.profile:  # a short timed warm-up: the server plans work from it
            profile = profile_device(trainer.model, torch.from_numpy(data.x[:16]),
                                     torch.from_numpy(data.y[:16]), device=trainer.device,
                                     amp=cfg.amp)
    if cfg.trainer == "zo":
        if not isinstance(trainer, SettingsTrainer):
            raise ValueError("--trainer zo needs Murmura's own trainer; this app defines "
                             "train()")
        trainer.train_zeroth_order_only(cfg.zo_lr)
    running = StatusTrainer(trainer, cfg.status_file) if cfg.status_file else trainer
    running = with_client_eval(running, trainer, task, data, index=cfg.client_index,
                               num_clients=cfg.num_clients, seed=task_cfg.data_seed)
    return ClientRuntime(transport, running, client_id=cfg.client_id, identity=identity,
                         profile=profile, token=cfg.token, codec=cfg.codec, wait_s=cfg.wait_s,
                         update_hook=attack.update,
                         retry=RetryPolicy(give_up_after_s=cfg.give_up_after_s),
                         give_up_unreached_s=cfg.give_up_unreached_s,
                         on_ack=ack_logger(cfg.ack_log) if cfg.ack_log else None,
                         require_secagg=cfg.secure_aggregation)


def ack_logger(path: str) -> Callable[[str, PushResult], None]:
    """Append one JSON line per acknowledged update: id, version, staleness, duplicate."""
    def log_ack(update_id: str, reply: Any) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"update_id": update_id, "version": reply.version,
                                "staleness": reply.staleness,
                                "duplicate": reply.duplicate}) + "\n")
    return log_ack
