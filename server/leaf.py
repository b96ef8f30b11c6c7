"""A leaf aggregator: folds its clients' updates and pushes the partial aggregate upstream.

A leaf is the same pipeline as the top aggregator (gateway, aggregation functions, publisher),
except for the last step: instead of making a new version, the publisher hands the rule's
partial aggregate (weighted sum, total weight, count) to the leaf's *upstream link*, which is
an ordinary :class:`~murmura.client.ClientRuntime` talking to the parent. To the parent a leaf
is one heavy client whose "training" is a round of its own clients:

1. the link pulls the parent's current version and installs it in the leaf's core, so the
   leaf's clients train on exactly the parent's model and version numbers;
2. the leaf's policy runs its round (sync) or fills its buffer (async) as a top aggregator
   would, folding each update with the same weights and staleness discounts;
3. the publisher forwards the partial; the link pushes it with codec ``partial`` (retries,
   re-joins and update ids come with the runtime), and waits for the parent's next task.

A middle level is a leaf whose clients are leaves: it merges their partials. With
``accumulator = "exact"`` on every level the top's model is bit-identical to a flat run on the
same updates (the sums are exact, so grouping cannot change them); with float32 they agree to
float32 rounding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import queue
import secrets
import socket
import threading
from pathlib import Path
from typing import Any

from murmura.aggregation import Aggregator
from murmura.client import ClientRuntime, GrpcTransport, RemoteError, Trainer, TrainResult
from murmura.protocols import DeviceProfile, FlatVector, ModelSpec, TaskSettings
from murmura.protocols.codecs.partial import encode_partial
from murmura.protocols.identity import NodeKey
from murmura.protocols.tls import ClientTls
from murmura.server.app import AggregatorServer, build_core
from murmura.server.config import ServerConfig
from murmura.server.core import AggregatorCore
from murmura.server.decoding import PARTIAL_CODEC
from murmura.tasks import TaskConfig

log = logging.getLogger(__name__)

#: A leaf makes no versions of its own; the parent's max_versions ends the run.
_NO_LIMIT = 1 << 62


def partial_payload(aggregator: Aggregator) -> tuple[bytes, float, int]:
    """``(payload, weight, count)`` of the partial aggregate ``aggregator`` holds."""
    partial = aggregator.partial()  # type: ignore[attr-defined]
    return encode_partial(**partial.as_arrays()), float(partial.weight), int(partial.count)


#: Refusals of a partial that end the leaf's link (with the parent's reason in the log): no
#: later partial would be taken either, and dropping its clients' work silently is worse.
LEAF_FATAL_REFUSALS = frozenset({"PERMISSION_DENIED"})


class LeafTrainer(Trainer):
    """The upstream link's trainer: 'training' on the parent's model is one local round."""

    def __init__(self, core: AggregatorCore) -> None:
        self.core = core
        self.spec: ModelSpec = core.spec
        self._version = 0
        self._partials: queue.Queue[tuple[bytes, float, int]] = queue.Queue()
        self.stopping = threading.Event()
        #: Partials made and the client updates folded into them; the most clients joined.
        self.partials_made = 0
        self.updates_folded = 0
        self.clients = 0

    def on_pull(self, version: int) -> None:
        self._version = version

    def forward(self, aggregator: Aggregator, updates: int) -> None:
        """The core's publish step on a leaf (publisher thread): queue the partial and
        record its row (a leaf's metrics.jsonl lists the partials it made, not versions)."""
        try:
            payload, weight, count = partial_payload(aggregator)
        finally:
            aggregator.reset()
        core = self.core
        self.partials_made += 1
        self.updates_folded += count
        self.clients = max(self.clients, len(core.sessions))
        if core.recorder is not None:
            core.recorder.record({
                "partial": self.partials_made, "parent_version": self._version,
                "updates_in_partial": count, "weight": weight, "partial_bytes": len(payload),
                "time_s": round(core.clock() - core.t0, 6), "updates": core.traffic.updates,
                "bytes_up": core.traffic.bytes_up, "bytes_down": core.traffic.bytes_down,
                "clients": len(core.sessions),
                "refused": dict(sorted(core.traffic.refused.items()))})
        self._partials.put((payload, weight, count))

    def train(self, params: FlatVector, settings: TaskSettings, *, seed: int) -> TrainResult:
        version, core = self._version, self.core
        core.post(lambda: core.install(version, params))  # the leaf's clients train on it
        while not self.stopping.is_set():
            try:
                payload, weight, count = self._partials.get(timeout=0.25)
            except queue.Empty:
                continue
            log.info("leaf: forwarding %d updates (weight %g) trained on version %d", count,
                     weight, version)
            return TrainResult(params=None, num_examples=max(1, round(weight)),
                               metrics={"updates": float(count)},
                               encoded=(PARTIAL_CODEC, payload))
        raise RemoteError("CANCELLED", "the leaf is shutting down")


class Leaf:
    """A leaf aggregator server plus its upstream link (started with :meth:`start`)."""

    def __init__(self, config: ServerConfig, task_config: TaskConfig, *,
                 out_dir: str | Path | None = None, evaluate: bool = False,
                 connect_timeout_s: float = 30.0) -> None:
        if config.leaf.role != "leaf":
            raise ValueError("Leaf needs a config with role 'leaf'")
        self.config = config
        self.task_config = task_config
        self.out_dir = out_dir
        self.evaluate = evaluate
        #: How long start() waits for the parent to answer (it may start after the leaf).
        self.connect_timeout_s = connect_timeout_s
        #: The leaf's identity at the parent (its id derives from the key): the parent folds
        #: a sync round in sorted id order, so give a persistent key (--key) for an order that
        #: is stable across restarts.
        self.identity = NodeKey.load(config.leaf.key) if config.leaf.key else NodeKey.generate()
        #: How the leaf names itself in logs (its id at the parent is the key's).
        self.name = config.leaf.name or _default_name(config.address)
        self.core: AggregatorCore | None = None
        self.server: AggregatorServer | None = None
        self.trainer: LeafTrainer | None = None
        self._link: threading.Thread | None = None
        self.link_error: BaseException | None = None
        self._runtime: ClientRuntime | None = None

    @property
    def address(self) -> str:
        assert self.server is not None
        return self.server.address

    async def start(self) -> None:
        """Learn the parent's settings, start serving clients, then join the parent."""
        loop = asyncio.get_running_loop()
        settings = await loop.run_in_executor(None, self._parent_settings)
        config = dataclasses.replace(self.config, train=settings, max_versions=_NO_LIMIT)
        core = build_core(config, self.task_config, out_dir=self.out_dir,
                          evaluate=self.evaluate, checkpoint=False, fresh_metrics=True)
        self.trainer = LeafTrainer(core)
        core.forward = self.trainer.forward
        core.ready = False  # no client trains before the parent's model is installed
        self.core = core
        self.server = AggregatorServer(core)
        await self.server.start()
        self._link = threading.Thread(target=self._run_link, name="murmura-upstream",
                                      daemon=True)
        self._link.start()
        log.info("leaf %s serves clients on %s, upstream %s", self.name, self.server.address,
                 self.config.leaf.upstream)

    def _upstream(self, timeout_s: float | None = None) -> GrpcTransport:
        """The link to the parent; with ``timeout_s``, calls and the first connection wait
        that long (a parent that starts after the leaf)."""
        cfg, insecure = self.config.leaf, self.config.security.insecure
        tls = (ClientTls(cfg.upstream_tls_ca, cfg.upstream_tls_cert, cfg.upstream_tls_key)
               if cfg.upstream_tls_ca else None)
        if timeout_s is None:  # the transport's own defaults
            return GrpcTransport(cfg.upstream, tls=tls, insecure=insecure)
        return GrpcTransport(cfg.upstream, tls=tls, insecure=insecure, timeout_s=timeout_s,
                             connect_timeout_s=timeout_s)

    def _parent_settings(self) -> TaskSettings:
        # Joined under the leaf's own id and not left: the link's join takes the identity over,
        # so no second identity ever sits in one of the parent's cohorts.
        transport = self._upstream(timeout_s=self.connect_timeout_s)
        try:
            result, _ = transport.join_as(self.identity, DeviceProfile(device="leaf"),
                                          self.config.security.join_token)
        except RemoteError as exc:
            parent = self.config.leaf.upstream
            if exc.retryable:
                raise ValueError(f"cannot reach the parent aggregator at {parent} (waited "
                                 f"{self.connect_timeout_s:g} s): {exc.status}") from None
            raise ValueError(f"the parent aggregator at {parent} refused this leaf: "
                             f"{exc.message}") from None
        finally:
            transport.close()
        log.info("leaf %s: the parent's settings read; the upstream link joins again under "
                 "the same id, replacing this session", self.name)
        return result.settings

    def _run_link(self) -> None:
        assert self.core is not None and self.trainer is not None
        core = self.core
        transport = self._upstream()
        try:
            runtime = ClientRuntime(transport, self.trainer, identity=self.identity,
                                    profile=DeviceProfile(device="leaf", device_name=self.address),
                                    token=self.config.security.join_token,
                                    fatal_refusals=LEAF_FATAL_REFUSALS)
            self._runtime = runtime
            runtime.run()
            log.info("leaf %s: the parent says stop", self.name)
        except BaseException as exc:  # the link failed for good: stop serving
            if not self.trainer.stopping.is_set():
                self.link_error = exc
                log.error("leaf %s: upstream link failed: %s", self.name, exc)
        finally:
            transport.close()
            core.post(core.stop)

    def summary(self, *, wall_s: float = 0.0) -> dict[str, Any]:
        """What this leaf forwarded: partials made, sent and refused upstream, client updates
        folded, clients, bytes. A leaf makes no versions and evaluates nothing, so there is no
        accuracy here: the results are the parent's."""
        trainer, core = self.trainer, self.core
        stats = self._runtime.stats if self._runtime is not None else None
        return {
            "role": "leaf", "name": self.name, "upstream": self.config.leaf.upstream,
            "partials_made": trainer.partials_made if trainer is not None else 0,
            "partials_sent": stats.pushed if stats is not None else 0,
            "partials_refused": stats.refused if stats is not None else 0,
            "partial_bytes_sent": stats.bytes_payload if stats is not None else 0,
            "updates_folded": trainer.updates_folded if trainer is not None else 0,
            "updates": core.traffic.updates if core is not None else 0,
            "clients": trainer.clients if trainer is not None else 0,
            "bytes_up": core.traffic.bytes_up if core is not None else 0,
            "bytes_down": core.traffic.bytes_down if core is not None else 0,
            "refused": dict(sorted(core.traffic.refused.items())) if core is not None else {},
            "link_error": str(self.link_error) if self.link_error is not None else None,
            "wall_s": round(wall_s, 3),
        }

    def finish(self, *, wall_s: float = 0.0) -> dict[str, Any]:
        """Close metrics.jsonl (one row per partial) and write summary.json (:meth:`summary`)
        in the output directory; call after :meth:`stop`. Returns the summary."""
        summary = self.summary(wall_s=wall_s)
        recorder = self.core.recorder if self.core is not None else None
        if recorder is not None:
            recorder.finish(plot=False)  # closes the rows; its summary is replaced below
            text = json.dumps(summary, indent=2, sort_keys=True, default=str)
            (recorder.out_dir / "summary.json").write_text(text, encoding="utf-8")
        return summary

    async def wait_done(self, timeout: float | None = None) -> bool:
        assert self.server is not None
        return await self.server.wait_done(timeout)

    async def stop(self, grace: float | None = 1.0) -> None:
        if self.trainer is not None:
            self.trainer.stopping.set()
        if self.server is not None:
            await self.server.stop(grace)
        if self._link is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._link.join, 30)


def _default_name(address: str) -> str:
    port = address.rsplit(":", 1)[-1]
    suffix = port if port not in ("", "0") else secrets.token_hex(3)
    return f"leaf-{socket.gethostname()}-{suffix}"


__all__ = ["Leaf", "LeafTrainer", "partial_payload"]
