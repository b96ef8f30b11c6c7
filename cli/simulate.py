"""``murmura simulate``: the command, and the same thing from Python for a config file.

The config file is ``murmura run``'s: ``[task]`` and ``[server]`` mean the same, ``[simulation]``
configures the virtual clients (see :class:`SimulationConfig`), and ``[run]`` is ignored except
that its ``clients`` is the default number of virtual clients. Flags override the file.
``--device`` (``device`` in ``[simulation]``) trains the virtual clients on a GPU; the
summary's ``simulation`` entry records the device and the chunk size used.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from murmura.clients import add_flower_arguments
from murmura.config import add_arguments, build, read_toml
from murmura.gossip import GossipConfig
from murmura.progress import Progress
from murmura.server import ServerConfig
from murmura.simulation.config import SimulationConfig
from murmura.tasks import TaskConfig

if TYPE_CHECKING:  # the engine loads torch: imported by the commands, not by the parser
    from murmura.simulation.engine import SimulationResult

DESCRIPTION = (
    "Simulate a federation of virtual clients on this machine: the real aggregator policies, "
    "aggregation rules, codecs and trainers, with an in-memory transport and a virtual clock "
    "(device speed, bandwidth, latency and availability per client). Writes metrics.jsonl, "
    "summary.json and plots to --out, with time_s in virtual seconds.")


def add_parser(subparsers: Any) -> None:
    """Add ``simulate`` to the ``murmura`` command's subparsers."""
    p = subparsers.add_parser("simulate", help="thousands of virtual clients in virtual time",
                              description=DESCRIPTION)
    p.add_argument("--config", help="TOML file with [task], [server], [simulation] tables "
                   "(murmura run's file works as it is)")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more log output (repeat for more: -vv)")
    p.add_argument("-q", "--quiet", action="count", default=0,
                   help="less output: no start-up or progress lines, only warnings and the "
                   "result")
    add_arguments(p, SimulationConfig, title="simulation")
    add_arguments(p, TaskConfig, title="task")
    add_arguments(p, ServerConfig, title="server", skip=("address", "metrics_address"))
    add_arguments(p, GossipConfig, title="gossip (with --gossip)")
    add_flower_arguments(p, "simulate the clients and model of")
    p.set_defaults(fn=cmd_simulate)


def load_configs(toml: dict[str, Any], args: argparse.Namespace | None = None
                 ) -> tuple[TaskConfig, ServerConfig, SimulationConfig, bool]:
    """(task, server, simulation, whether min_clients was given) from a TOML dict and flags."""
    table = dict(toml.get("simulation", {}))
    run = toml.get("run", {})
    if "clients" not in table and "clients" in run:
        table["clients"] = run["clients"]
    sim = build(SimulationConfig, table, args, section="simulation")
    task = build(TaskConfig, toml.get("task"), args, section="task")
    server = build(ServerConfig, toml.get("server"), args, section="server")
    given_min = (args is not None and getattr(args, "min_clients", None) is not None) \
        or "min_clients" in toml.get("server", {})
    return task, server, sim, given_min


def simulate_file(path: str | Path, **overrides: Any) -> SimulationResult:
    """Run ``murmura simulate --config PATH`` from Python; ``overrides`` are flag values by
    field name (e.g. ``clients=1000, max_versions=5``)."""
    from murmura.simulation.api import simulate

    args = argparse.Namespace(**overrides)
    task, server, sim, given_min = load_configs(read_toml(path), args)
    return simulate(task, server, sim, wait_for_all_clients=not given_min)


def cmd_simulate(args: argparse.Namespace) -> int:
    from murmura.simulation.api import prepare_server
    from murmura.simulation.engine import Simulation

    level = logging.WARNING - 10 * args.verbose + 10 * args.quiet
    logging.basicConfig(level=max(level, logging.DEBUG), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    toml = read_toml(args.config)
    task, server, sim, given_min = load_configs(toml, args)
    if sim.gossip and getattr(args, "flower_app", None):
        raise ValueError("--flower-app runs with an aggregator; it does not take --gossip")
    if getattr(args, "flower_app", None) and sim.device not in ("cpu", "auto"):
        raise ValueError(f"--flower-app runs the app's own client code, which picks its own "
                         f"device; it does not take --device {sim.device}")
    if sim.gossip:
        return _simulate_gossip(task, sim, toml, args)
    quiet = args.quiet > 0
    server = prepare_server(server, sim, wait_for_all_clients=not given_min)  # refuses first
    flower = getattr(args, "flower_app", None)
    engine: Simulation
    if flower:  # a Flower app's clients as the virtual clients (docs/flower.md)
        from murmura.clients import flower_given
        from murmura.server.flower import given_keys
        from murmura.simulation.flower import FlowerSimulation

        engine = FlowerSimulation(flower, server, sim, run_config=args.run_config,
                                  given=sorted(given_keys(args, toml) | flower_given(args, toml)))
        server = engine.server_config
    if not quiet:
        print(f"murmura simulate: {sim.clients} virtual clients, mode={server.mode}, "
              f"task={flower or task.app or task.task}, codec={server.train.codec}, "
              f"speed spread "
              f"{sim.speed_spread:g}x, availability={sim.availability}, "
              + (f"device={sim.device}, " if sim.device != "cpu" else "")
              + f"out={sim.out}", file=sys.stderr)
    progress = Progress(server.max_versions, quiet=quiet)
    if flower:
        engine.progress = progress.update
    else:
        engine = Simulation(task, server, sim, progress=progress.update)
    from murmura.run import on_sigint

    interrupted = False
    try:  # Ctrl-C: the run stops between two events, then summarises and plots what ran
        with on_sigint(engine.stop, quiet, what="stopping the simulation"):
            engine.advance()
    except KeyboardInterrupt:  # a second Ctrl-C
        interrupted = True
    finally:
        progress.close()
    interrupted = interrupted or engine.stop.is_set()
    result = engine.finish()
    if interrupted:
        print(f"interrupted at version {result.version} ({result.virtual_s:.1f} virtual s)",
              file=sys.stderr)
    s, stats = result.summary, result.summary["simulation"]
    acc = s.get("final_accuracy")
    print(f"execution: {stats['execution']}")
    if acc is None:
        print("no version was published")
    else:
        ppl = result.rows[-1].get("perplexity") if result.rows else None  # the lm task's
        print(f"final test accuracy {acc:.4f}"
              + (f", perplexity {ppl:.2f}" if isinstance(ppl, float) else "")
              + f" after {s['versions']} versions "
              f"({s['updates']} updates, {s['bytes_up'] / 1e6:.2f} MB up) in "
              f"{result.virtual_s:.1f} virtual s ({result.wall_s:.1f} s wall, "
              f"{stats['updates_per_wall_s'] or 0:.0f} client updates/s)")
    if sim.out:
        plots = "accuracy.png" + (", staleness.png"
                                  if (Path(sim.out) / "staleness.png").exists() else "")
        print(f"results: {sim.out}/metrics.jsonl, {sim.out}/summary.json, {sim.out}/{{{plots}}}")
    else:
        print("results: not written (--out '')")
    if interrupted:
        return 130
    if not stats["done"]:
        reason = ("max_time_s reached" if sim.max_time_s and result.virtual_s >= sim.max_time_s
                  else "no client could make progress")
        print(f"run did not reach max_versions: {reason} at version {result.version}",
              file=sys.stderr)
        return 0 if sim.max_time_s and result.virtual_s >= sim.max_time_s else 1
    return 0


def _simulate_gossip(task: TaskConfig, sim: SimulationConfig, toml: dict[str, Any],
                     args: argparse.Namespace) -> int:
    from murmura.simulation.gossip import GossipFailures, GossipSimulation

    gossip = build(GossipConfig, toml.get("gossip"), args, section="gossip")
    failures = GossipFailures(sim.churn_per_round, sim.fail_fraction, sim.fail_round)
    print(f"murmura simulate --gossip: {sim.clients} virtual peers, topology "
          f"{gossip.topology}, {gossip.rounds} rounds, task={task.task}, out={sim.out}",
          file=sys.stderr)
    progress = Progress(gossip.rounds, quiet=args.quiet > 0)
    try:
        result = GossipSimulation(task, gossip, sim, failures=failures,
                                  progress=progress.update).run()
    finally:
        progress.close()
    last = result.rows[-1]
    print(f"final mean peer accuracy {last['accuracy']:.4f} (min {last['accuracy_min']:.4f}) "
          f"after {last['round']} rounds, consensus distance "
          f"{last['consensus_distance']:.4f}, {result.bytes_per_peer_round / 1024:.1f} KiB "
          f"per peer per round, {result.virtual_s:.1f} virtual s ({result.wall_s:.1f} s wall)")
    print(f"results: {sim.out}/metrics.jsonl, {sim.out}/summary.json, {sim.out}/accuracy.png"
          if sim.out else "results: not written (--out '')")
    return 0


__all__ = ["add_parser", "cmd_simulate", "load_configs", "simulate_file"]
