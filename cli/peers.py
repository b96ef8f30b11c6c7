"""``murmura peer`` and ``murmura run --gossip``: gossip-mode peers from the command line.

``murmura run --gossip`` forks N peer processes on loopback (peer 0 first; the others
bootstrap from it), then follows their per-round reports: for each round it writes one
metrics row with the mean, min and max test accuracy over the peers and the consensus
distance (root mean square distance of the peer models to their mean), with the same progress
bar, summary.json and plot as ``murmura run``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from murmura.config import build, read_toml
from murmura.progress import Progress
from murmura.runs import LiveRun

if TYPE_CHECKING:  # imported where used: building the parser loads no numpy
    import numpy as np

log = logging.getLogger("murmura")

__all__ = ["GossipRun", "cmd_peer", "cmd_run_gossip", "consensus_row"]


# -- murmura peer -----------------------------------------------------------------------------

def cmd_peer(args: argparse.Namespace) -> int:
    from murmura.client import RemoteError
    from murmura.gossip import GossipConfig, PeerConfig
    from murmura.gossip.process import build_peer
    from murmura.tasks import TaskConfig

    level = logging.INFO - 10 * args.verbose + 10 * args.quiet
    logging.basicConfig(level=max(level, logging.DEBUG), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    toml = read_toml(args.config)
    cfg = build(PeerConfig, toml.get("peer"), args, section="peer")
    task = build(TaskConfig, toml.get("task"), args, section="task")
    gossip = build(GossipConfig, toml.get("gossip"), args, section="gossip")
    live = LiveRun(None, "peer", args.metrics_address, quiet=args.quiet > 0)  # binds now
    last: dict[str, Any] = {}

    # the dashboard's rows (--dashboard): a peer writes no run directory, so its rounds go to
    # a metrics.jsonl of its own that the page follows, removed when the peer stops
    rows = tempfile.TemporaryDirectory(prefix="murmura-peer-") if args.dashboard else None

    def show(round_: int, metrics: dict[str, Any]) -> None:
        """A line per round: this peer's model on the test set, and what it mixed."""
        last.update(metrics, round=round_)
        if rows is not None:
            with open(Path(rows.name) / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"version": round_ + 1, "round": round_ + 1,
                                    **{k: v for k, v in metrics.items()
                                       if isinstance(v, (int, float, str))}}) + "\n")
        if args.quiet == 0:
            acc = metrics.get("accuracy")
            print(f"round {round_ + 1}/{gossip.rounds}"
                  + (f": accuracy {acc:.4f}" if isinstance(acc, float) else "")
                  + f", mixed {metrics.get('mixed', 0)} models, view {metrics.get('view', 0)}",
                  flush=True)

    runtime = build_peer(cfg, task, gossip, on_metrics=show)
    for sig in (signal.SIGINT, signal.SIGTERM):  # graceful leave: finish the round, goodbye
        signal.signal(sig, lambda *_: runtime.stop())
    try:
        address = runtime.start()
    except RemoteError as exc:
        print(f"murmura peer: {exc}", file=sys.stderr)
        runtime.close()
        return 2
    print(f"murmura peer {cfg.identity()} listening on {address}", flush=True)
    live.serving(address, peer=runtime, peer_metrics=lambda: dict(last))
    dashboard = _peer_dashboard(args, runtime, last, rows)
    if not cfg.bootstrap_list() and gossip.min_peers <= 1:
        # Legitimate for the first peer of a network, and a surprise for anyone who forgot
        # --bootstrap: say what is about to happen and how to change it.
        print(f"murmura peer {cfg.identity()}: no --bootstrap, so this is the first peer of a "
              f"new network and it starts training at once; other peers join with "
              f"--bootstrap {address} (give --min-peers N to wait for N-1 of them first)",
              file=sys.stderr, flush=True)
    try:
        stats = runtime.run()
    finally:
        live.close()
        if dashboard is not None:
            dashboard.cancel_poster()
            dashboard.stop()
        if rows is not None:
            rows.cleanup()
    print(f"peer {cfg.identity()}: {stats.rounds} rounds, {stats.sent} models sent, "
          f"{stats.received} received, {stats.send_failures} failed sends"
          + (f"; final test accuracy {last['accuracy']:.4f}"
             if isinstance(last.get("accuracy"), float) else ""), flush=True)
    if stats.rounds and not stats.sent and not stats.received:
        print(f"murmura peer {cfg.identity()}: warning: no other peer was ever reached, so "
              f"this model was trained on this peer's data share alone", file=sys.stderr,
              flush=True)
    return 0


def _peer_dashboard(args: argparse.Namespace, runtime: Any, last: dict[str, Any],
                    rows: Any) -> Any:
    """``--dashboard``: the peer's page (its view of the other peers, its rounds and
    accuracy), or None without the flag."""
    if rows is None:
        return None
    from murmura.dashboard import announce, plan_for, start_peer_live
    from murmura.gossip.prometheus import peer_snapshot

    started = time.time()
    dashboard = start_peer_live(
        plan_for(args),
        lambda: peer_snapshot(runtime, metrics=lambda: dict(last), started_unix=started),
        Path(rows.name))
    announce(dashboard)
    return dashboard


# -- murmura run --gossip ---------------------------------------------------------------------

def consensus_row(round_: int, rows: list[dict[str, Any]], models: list[np.ndarray], *,
                  updates_before: int = 0) -> dict[str, Any]:
    """One metrics row from the peers' reports of a round (and their models). ``updates``
    is the run's total so far (``updates_before`` plus this round's, ``updates_in_round``),
    so the summary, which reads the last row, counts the whole run."""
    import numpy as np

    mixed = int(sum(r.get("mixed", 0) for r in rows))
    accs = [r["accuracy"] for r in rows if r.get("accuracy") is not None]
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    distance = None
    if models:
        stack = np.stack(models).astype(np.float64)
        distance = float(np.sqrt(((stack - stack.mean(axis=0)) ** 2).sum(axis=1).mean()))
    return {
        "version": round_ + 1, "round": round_ + 1, "peers": len(rows),
        "accuracy": float(np.mean(accs)) if accs else None,
        "accuracy_min": float(min(accs)) if accs else None,
        "accuracy_max": float(max(accs)) if accs else None,
        "loss": float(np.mean(losses)) if losses else None,
        "consensus_distance": distance,
        "bytes_up": int(sum(r.get("bytes_sent", 0) for r in rows)),
        "updates": updates_before + mixed, "updates_in_round": mixed,
        "time_s": float(max((r.get("time_s", 0.0) for r in rows), default=0.0)),
    }


class GossipRun:
    """Follows the per-round reports of a set of peers (files in ``report``)."""

    def __init__(self, report: Path, peers: list[str], *, sampled: bool = False) -> None:
        self.report, self.peers = report, peers
        # MoDeST: only a round's aggregators report it (their aggregate), so a round is
        # complete once a later one is reported (or no peer is left)
        self.sampled = sampled
        self.rows: dict[str, dict[int, dict[str, Any]]] = {p: {} for p in peers}
        self._offsets: dict[str, int] = dict.fromkeys(peers, 0)
        self.next_round = 0
        self.bytes_before: dict[str, int] = dict.fromkeys(peers, 0)
        #: Updates mixed in the rounds written so far (rows count the run's total).
        self.updates = 0

    def poll(self) -> None:
        for p in self.peers:
            path = self.report / f"{p}.jsonl"
            if not path.exists():
                continue
            with path.open("r", encoding="utf-8") as f:
                f.seek(self._offsets[p])
                while True:
                    line = f.readline()
                    if not line.endswith("\n"):
                        break
                    self._offsets[p] += len(line.encode())
                    row = json.loads(line)
                    self.rows[p][int(row["round"])] = row

    def complete(self, alive: set[str]) -> list[dict[str, Any]]:
        """Rows for every round that each live peer has reported or jumped past (dead peers
        don't hold a round up); the peers' model files of those rounds are deleted once
        read."""
        out: list[dict[str, Any]] = []
        while True:
            r = self.next_round
            have = {p for p in self.peers if r in self.rows[p]}
            if self.sampled:
                later = any(self.rows[p] and max(self.rows[p]) > r for p in self.peers)
                if alive and not later:
                    return out
                if not have:  # no aggregator of round r reported it: skip the round
                    if not later:
                        return out
                    self.next_round += 1
                    continue
            else:
                # a peer that jumped past round r (it fell behind) never reports it
                passed = {p for p in self.peers if self.rows[p] and max(self.rows[p]) >= r}
                if not have or not alive <= passed:
                    return out
            rows, models = [], []
            for p in sorted(have):
                rows.append(self.rows[p][r])
                path = self.report / f"{p}-r{r:05d}.npy"
                if path.exists():
                    import numpy as np

                    models.append(np.load(path))
                    path.unlink()
            row = consensus_row(r, rows, models, updates_before=self.updates)
            self.updates = row["updates"]
            out.append(row)
            self.next_round += 1


def cmd_run_gossip(args: argparse.Namespace, run: Any, toml: dict[str, Any]) -> int:
    import multiprocessing as mp

    from murmura.gossip import GossipConfig, PeerConfig
    from murmura.server.outputs import RunRecorder
    from murmura.tasks import TaskConfig

    task = build(TaskConfig, toml.get("task"), args, section="task")
    gossip = build(GossipConfig, toml.get("gossip"), args, section="gossip",
                   overrides={} if args.min_peers is not None else {"min_peers": run.clients})
    out = Path(run.out)
    report = out / "peers"
    report.mkdir(parents=True, exist_ok=True)
    for stale in [*report.glob("*.jsonl"), *report.glob("*.npy"), out / "metrics.jsonl"]:
        if stale.exists():
            stale.unlink()
    quiet = getattr(args, "quiet", 0) > 0
    if not quiet:
        print(f"murmura run --gossip: {run.clients} peers, topology={gossip.topology}, "
              f"rounds={gossip.rounds}, task={task.task}, out={out}", file=sys.stderr)
    t0 = time.monotonic()
    # Imported once here and shared by the forked peers (copy-on-write): the first optimizer
    # step imports torch._dynamo lazily, 5 s per process on a small machine. Import only: no
    # torch op and no gRPC channel may run in this process before the fork.
    import torch._dynamo  # noqa: F401

    from murmura.gossip.process import peer_process

    ctx = mp.get_context("fork") if sys.platform.startswith("linux") else mp.get_context("spawn")
    ready = ctx.Queue()
    procs = []
    ids = [f"peer-{i:03d}" for i in range(run.clients)]
    sys.stdout.flush()
    sys.stderr.flush()
    first = PeerConfig(client_index=0, num_clients=run.clients, report=str(report),
                       threads=run.client_threads, device=args.device or "cpu")
    procs.append(ctx.Process(target=peer_process, name=ids[0],
                             args=(first, task, gossip, ready,
                                   str(out / "peers" / f"{ids[0]}.log"))))
    procs[0].start()
    try:
        bootstrap = ready.get(timeout=120)[2]
    except Exception:
        print(f"the first peer did not start (see its log: {out / 'peers' / ids[0]}.log)",
              file=sys.stderr)
        _stop(procs, logs=out / "peers")
        return 1
    for i in range(1, run.clients):
        cfg = PeerConfig(client_index=i, num_clients=run.clients, report=str(report),
                         bootstrap=bootstrap, threads=run.client_threads,
                         device=args.device or "cpu")
        p = ctx.Process(target=peer_process, name=ids[i],
                        args=(cfg, task, gossip, None, str(out / "peers" / f"{ids[i]}.log")))
        p.start()
        procs.append(p)
    if not quiet:
        print(f"first peer listening on {bootstrap}", file=sys.stderr)
    live = LiveRun(out, "run --gossip").serving(bootstrap, mode=f"gossip/{gossip.topology}")
    recorder = RunRecorder(out, config={"run": asdict(run), "task": asdict(task),
                                        "gossip": asdict(gossip)})
    progress = Progress(gossip.rounds, quiet=quiet)
    follow = GossipRun(report, ids, sampled=gossip.topology == "modest")
    try:
        while time.monotonic() - t0 < run.timeout_s:
            alive = {ids[i] for i, p in enumerate(procs) if p.is_alive()}
            follow.poll()
            for row in follow.complete(alive):
                recorder.record(row)
                progress.update(row)
            if not alive:
                break
            time.sleep(0.2)
    finally:
        progress.close()
        failed = _stop(procs, logs=out / "peers")
        live.close()
    follow.poll()
    for row in follow.complete(set()):
        recorder.record(row)
    last = recorder.rows[-1] if recorder.rows else {}
    summary = recorder.finish({"wall_s": time.monotonic() - t0, "peers_failed": failed,
                               "rounds": last.get("round", 0),
                               "final_accuracy_min": last.get("accuracy_min"),
                               "final_accuracy_max": last.get("accuracy_max"),
                               "final_consensus_distance": last.get("consensus_distance")})
    finished = last.get("round", 0) >= gossip.rounds
    acc = summary.get("final_accuracy")
    if acc is not None:
        print(f"final mean test accuracy {acc:.4f} (min {last['accuracy_min']:.4f}, max "
              f"{last['accuracy_max']:.4f}) after {last['round']} rounds, consensus distance "
              f"{last['consensus_distance']:.4f}, {summary['bytes_up'] / 1e6:.2f} MB sent "
              f"in {summary['wall_s']:.1f} s")
    else:
        print("no round was completed")
    print(f"results: {out}/metrics.jsonl, {out}/summary.json, {out}/accuracy.png")
    return 0 if finished and not failed else 1


def _stop(procs: list[Any], grace_s: float = 30.0, *, logs: Path | None = None) -> int:
    deadline = time.monotonic() + grace_s
    failed = 0
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
        if p.is_alive():
            p.terminate()
            p.join(10)
        if p.exitcode not in (0, -signal.SIGTERM):
            failed += 1
            where = f"its log: {logs / p.name}.log" if logs is not None else "its log"
            log.error("peer process %s exited with code %s (see %s)", p.name, p.exitcode, where)
    return failed


