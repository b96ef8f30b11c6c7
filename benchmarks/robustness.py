"""Robust aggregation under attack: accuracy and targeted-attack success for every defence.

One grid, the same clients, split, seeds and attackers for every cell:

* **task** — digits, the bundled MLP, 20 honest clients with a Dirichlet(0.5) label split
  (data seed 0). Attackers are *extra* identities (clients 20 onwards) next to the 20 honest
  ones, so every scenario keeps the same honest data and the no-attack FedAvg run is a fair
  baseline.
* **driver** — every cell is a :class:`~murmura.simulation.Simulation`: the real
  :class:`~murmura.server.AggregatorCore`, the deployment's ``TorchTrainer`` (the loop
  executor), codec, update ids and refusal rules, in virtual time. ``sync``: every identity
  trains every round (equal devices, always online, ``min_clients`` = all, the whole cohort).
  ``async``: FedBuff (``buffer_size`` updates per version) with device speeds spread
  ``ASYNC_SPREAD``x, so staleness comes from the event order: a client's update is as stale
  as the number of versions published while it trained. Async runs take as many updates in
  total as sync runs.
* **attacks** (the attacked class pair is 1 -> 7), injected through the engine's hooks:
  per-client attacks are the :class:`~murmura.client.malicious.Attack` a deployed malicious
  client runs (``make_attack``): ``label-flip`` (attackers train on data half of which is 1s,
  relabelled 7 by the attack's data transform), ``sign-flip`` (-3 x own honest update),
  ``noise`` (Gaussian in place of the update, 5 x its norm) and ``boost`` (label-flip update
  scaled by 5 = honest/attackers). Harness-level attacks are an ``update_hook`` over each
  training batch: ``sybil`` (k identities sending one label-flip-trained update per base
  version, each with 5 % jitter, ``sybil_clones``), ``alie`` (mean - z std of the latest
  honest updates, Baruch et al.'s z) and ``ipm`` (-5 x their mean). In sync runs the whole
  cohort trains in one batch, so ALIE / IPM see the round's honest updates; in async runs
  they see each honest client's latest update (in flight or just pushed). Byzantine attackers
  are 20 % of identities (5 next to 20 honest); Sybils 10 / 30 / 50 % (2, 9, 20 clones).
  Attackers hold the honest mean example count, and claim it.
* **defences** — registry names with their default options: ``fedavg`` (none), ``clip``,
  ``median``, ``trimmed-mean``, ``krum`` (f=1), ``centered-clip``, ``sybil`` and ``default``.
* **metrics** — clean accuracy on the 359-image test set and attack success (share of test
  1s classified as 7), each the mean over the last 3 global versions.

A second part times ``result()`` of each rule for n updates of a 1 M-parameter model.

Run: ``python benchmarks/robustness.py [--quick]``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Column, Report, parse_args, progress, pyplot  # noqa: E402
from murmura.aggregation import create_aggregator  # noqa: E402
from murmura.client.attacks import alie, ipm, sybil_clones  # noqa: E402
from murmura.client.malicious import Attack, make_attack  # noqa: E402
from murmura.protocols import ModelSpec, TaskSettings  # noqa: E402
from murmura.server import ServerConfig  # noqa: E402
from murmura.simulation import (  # noqa: E402
    Simulation,
    SimulationConfig,
    SimulationData,
    prepare_server,
)
from murmura.simulation.attacks import BatchHook, UpdateBatch  # noqa: E402
from murmura.tasks import TaskConfig, load_task  # noqa: E402

NAME = "robustness"
HONEST = 20
ALPHA = 0.5
SOURCE, TARGET = 1, 7
DEFENCES = ["fedavg", "clip", "median", "trimmed-mean", "krum", "centered-clip", "sybil",
            "default"]
SETTINGS = TaskSettings(local_epochs=2, batch_size=16, lr=0.1, momentum=0.5)
SIGN_SCALE, NOISE_MULT, BOOST, IPM_EPS, JITTER = 3.0, 5.0, 5.0, 5.0, 0.05
ASYNC_SPREAD = 4.0  # async: slowest / fastest device, so staleness comes from the event order
LAST = 3  # versions averaged for the metrics


@dataclass(frozen=True)
class Scenario:
    attack: str          # none, label-flip, sign-flip, noise, boost, sybil, alie, ipm
    share: float         # attackers' share of identities
    targeted: bool = False

    @property
    def label(self) -> str:
        return "no attack" if self.attack == "none" else f"{self.attack} {self.share:.0%}"

    @property
    def attackers(self) -> int:
        return 0 if self.share == 0 else round(self.share * HONEST / (1 - self.share))


SCENARIOS = [
    Scenario("none", 0.0),
    Scenario("label-flip", 0.2, True),
    Scenario("sign-flip", 0.2),
    Scenario("noise", 0.2),
    Scenario("boost", 0.2, True),
    Scenario("sybil", 0.1, True),
    Scenario("sybil", 0.3, True),
    Scenario("sybil", 0.5, True),
    Scenario("alie", 0.2),
    Scenario("ipm", 0.2),
]


# -- one federated run ---------------------------------------------------------------------


class Harness:
    """The task, the honest split and the attackers' data, shared by every run in a process."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.task_config = TaskConfig(task="digits", model="mlp", partition="dirichlet",
                                      alpha=ALPHA, data_seed=0)
        self.task = load_task(self.task_config)
        self.shares = [np.asarray(s, dtype=np.int64) for s in self.task.shares(HONEST)]
        self.mean_n = int(round(np.mean([len(s) for s in self.shares])))
        self.probe = self.task.build_model()
        self.spec = ModelSpec.from_module(self.probe)
        test = self.task.test
        self.test_x = torch.from_numpy(test.x)
        self.test_y = test.y
        self.source_mask = test.y == SOURCE

    def attacker_share(self, i: int) -> np.ndarray:
        """Attacker ``i``'s data, as indices into the training set: half source-class images,
        half other images, ``mean_n`` in all (so attackers claim the honest mean example
        count). Label-flipping attackers relabel it through their data attack."""
        train = self.task.train
        rng = np.random.default_rng([7, i])
        src = np.flatnonzero(train.y == SOURCE)
        rest = np.flatnonzero(train.y != SOURCE)
        half = self.mean_n // 2
        return np.concatenate([rng.choice(src, size=min(half, len(src)), replace=False),
                               rng.choice(rest, size=self.mean_n - half, replace=False)])

    def metrics(self, params: np.ndarray) -> tuple[float, float]:
        self.spec.load_into(self.probe, params)
        self.probe.eval()
        with torch.no_grad():
            pred = self.probe(self.test_x).argmax(dim=1).numpy()
        acc = float(np.mean(pred == self.test_y))
        asr = float(np.mean(pred[self.source_mask] == TARGET))
        return acc, asr


_HARNESS: Harness | None = None


def harness() -> Harness:
    global _HARNESS
    if _HARNESS is None:
        _HARNESS = Harness()
    return _HARNESS


# -- harness-level attacks: engine update hooks ---------------------------------------------


class CrowdAttack:
    """ALIE / IPM: every attacker in a batch sends one vector built from the latest update of
    each honest client (sync: the round's honest updates, which train in the attackers' batch;
    async: the honest updates in flight or just pushed)."""

    def __init__(self, kind: str, attackers: int) -> None:
        self.kind, self.attackers = kind, attackers
        self.latest: dict[int, np.ndarray] = {}

    def __call__(self, batch: UpdateBatch) -> dict[int, np.ndarray] | None:
        for c, u in zip(batch.clients, batch.updates, strict=True):
            if c < HONEST:
                self.latest[c] = u
        mine = [c for c in batch.clients if c >= HONEST]
        if not mine or not self.latest:
            return None
        honest = np.stack([self.latest[c] for c in sorted(self.latest)])
        if self.kind == "alie":
            v = alie(honest, num_clients=HONEST + self.attackers, num_byzantine=self.attackers)
        else:
            v = ipm(honest, eps=IPM_EPS)
        return dict.fromkeys(mine, v)


class SybilFlood:
    """Sybil clones: one label-flip-trained update per base version (the first Sybil's in
    the batch that trains from it), sent by every Sybil identity with its own 5 % jitter."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng([seed, 99])
        self.poison: dict[int, np.ndarray] = {}

    def __call__(self, batch: UpdateBatch) -> dict[int, np.ndarray]:
        out = {}
        for c, version, u in zip(batch.clients, batch.versions, batch.updates, strict=True):
            if c >= HONEST:
                poison = self.poison.setdefault(version, u)
                out[c] = sybil_clones(poison, k=1, jitter=JITTER, rng=self.rng)[0]
        return out


def scenario_attacks(sc: Scenario, seed: int) -> tuple[dict[int, Attack], BatchHook | None]:
    """The per-client attacks (what a deployed malicious client runs, ``make_attack``) and the
    harness hook of one scenario; attackers are clients ``HONEST`` onwards."""
    attackers = range(HONEST, HONEST + sc.attackers)
    flip = make_attack("label-flip", {"source": str(SOURCE), "target": str(TARGET)})
    if sc.attack in ("none", "alie", "ipm"):
        hook = CrowdAttack(sc.attack, sc.attackers) if sc.attackers else None
        return {}, hook
    if sc.attack in ("label-flip", "sybil"):
        return dict.fromkeys(attackers, flip), SybilFlood(seed) if sc.attack == "sybil" else None
    if sc.attack == "boost":
        boost = Attack(data=flip.data, update=make_attack("scale", {"factor": str(BOOST)}).update)
        return dict.fromkeys(attackers, boost), None
    if sc.attack == "sign-flip":
        return dict.fromkeys(attackers, make_attack("sign-flip", {"scale": str(SIGN_SCALE)})), None
    if sc.attack == "noise":
        return {c: make_attack("noise", {"std": str(NOISE_MULT), "relative": "1"},
                               seed=seed * 1000 + c) for c in attackers}, None
    raise ValueError(f"unknown scenario attack {sc.attack!r}")


def run_cell(args: tuple[str, Scenario, str, int, int, int]) -> dict[str, Any]:
    """One (defence, scenario, mode, seed) cell: a :class:`Simulation` of the honest clients
    and the attackers, with the attacks injected through the engine's hooks."""
    defence, sc, mode, rounds, buffer, seed = args
    t0 = time.perf_counter()
    h = harness()
    k = sc.attackers
    total = HONEST + k
    if mode == "sync":
        versions = rounds
    else:  # as many updates as the sync run takes
        versions = max(1, math.ceil(rounds * total / buffer))
    sim = SimulationConfig(clients=total, speed_spread=1.0 if mode == "sync" else ASYNC_SPREAD,
                           availability="always", vectorise="off", workers=1, threads=1)
    server = prepare_server(ServerConfig(
        mode=mode, max_versions=versions, min_clients=total, cohort_fraction=1.0,
        buffer_size=buffer, max_staleness=50, defense=defence, seed=seed, train=SETTINGS), sim)
    shares = h.shares + [h.attacker_share(0 if sc.attack == "sybil" else j) for j in range(k)]
    data = SimulationData(h.task, shares, f"{h.task_config.task} (bundled) + {k} attackers")
    attacks, hook = scenario_attacks(sc, seed)
    history: list[np.ndarray] = []
    engine: Simulation | None = None

    def on_version(_: dict[str, Any]) -> None:
        assert engine is not None
        history.append(engine.core.params.copy())

    engine = Simulation(h.task_config, server, sim, data=data, out_dir=None, evaluate=False,
                        progress=on_version, attacks=attacks, update_hook=hook)
    result = engine.run()
    m = np.array([h.metrics(p) for p in history[-LAST:]])
    return {"defence": defence, "attack": sc.attack, "share": sc.share, "scenario": sc.label,
            "targeted": sc.targeted, "attackers": k, "mode": mode,
            "accuracy": float(m[:, 0].mean()), "success": float(m[:, 1].mean()),
            "versions": result.version, "seconds": time.perf_counter() - t0,
            "staleness": {str(s): n for s, n in sorted(result.staleness.items())},
            "refused": result.summary["simulation"]["refused"]}


# -- aggregation cost ----------------------------------------------------------------------


def aggregation_cost(n: int, p: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal(p, dtype=np.float32) * np.float32(0.01)
    stack = rng.standard_normal((n, p), dtype=np.float32)
    stack *= np.float32(0.01)
    stack += base
    updates = list(stack)
    rows = []
    for rule in DEFENCES + ["multi-krum"]:
        agg = create_aggregator(rule, p)
        t0 = time.perf_counter()
        for i, u in enumerate(updates):
            agg.add(u, 100.0, client_id=f"c{i}")
        t_add = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = agg.result()
        t_res = time.perf_counter() - t0
        assert out.shape == (p,) and np.all(np.isfinite(out))
        rows.append({"rule": rule, "n": n, "params": p, "add_s": t_add, "result_s": t_res})
        progress(f"aggregation cost {rule}: add {t_add:.2f} s, result {t_res:.2f} s")
        del agg, out
    return rows


# -- the report ----------------------------------------------------------------------------


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def plot(report: Report, results: list[dict[str, Any]], modes: list[str]) -> None:
    plt = pyplot()
    labels = [s.label for s in SCENARIOS]
    fig, axes = plt.subplots(2, len(modes), figsize=(7 * len(modes), 9), squeeze=False)
    for c, mode in enumerate(modes):
        for r, (key, title, cmap) in enumerate([("accuracy", "clean accuracy (%)", "viridis"),
                                               ("success", "attack success (%)", "magma_r")]):
            grid = np.full((len(DEFENCES), len(labels)), np.nan)
            for row in results:
                if row["mode"] == mode:
                    grid[DEFENCES.index(row["defence"]), labels.index(row["scenario"])] = \
                        100 * row[key]
            ax = axes[r][c]
            im = ax.imshow(grid, cmap=cmap, vmin=0, vmax=100, aspect="auto")
            ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
            ax.set_yticks(range(len(DEFENCES)), DEFENCES, fontsize=8)
            for (y, x), v in np.ndenumerate(grid):
                if not np.isnan(v):
                    ax.text(x, y, f"{v:.0f}", ha="center", va="center", fontsize=7,
                            color="white" if (v < 50) == (key == "accuracy") else "black")
            ax.set_title(f"{mode}: {title}")
            fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    fig.savefig(report.plot_path(), dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    def extra(p: Any) -> None:
        p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
        p.add_argument("--agg-updates", type=int, default=None,
                       help="updates timed per rule at 1 M parameters (default 200)")

    args = parse_args(NAME, __doc__.splitlines()[0], argv, extra)
    torch.set_num_threads(1)
    rounds = 5 if args.quick else 15
    buffer = 10
    seeds = (0,) if args.quick else (0, 1)
    agg_n = args.agg_updates or (100 if args.quick else 1000)
    agg_p = 1_000_000
    modes = ["sync", "async"]
    report = Report(NAME, quick=args.quick, params={
        "honest_clients": HONEST, "alpha": ALPHA, "rounds": rounds, "async_buffer": buffer,
        "seeds": list(seeds), "settings": repr(SETTINGS), "defences": DEFENCES,
        "scenarios": [s.label for s in SCENARIOS], "source": SOURCE, "target": TARGET,
        "sign_scale": SIGN_SCALE, "noise_mult": NOISE_MULT, "boost": BOOST, "ipm_eps": IPM_EPS,
        "sybil_jitter": JITTER, "async_speed_spread": ASYNC_SPREAD,
        "aggregation_updates": agg_n, "aggregation_params": agg_p})
    cells = [(d, s, m, rounds, buffer, seed) for seed in seeds for m in modes
             for s in SCENARIOS for d in DEFENCES]
    progress(f"{len(cells)} runs on {args.workers} workers, {rounds} rounds each")
    t0 = time.perf_counter()
    per_seed: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for i, row in enumerate(pool.map(run_cell, cells)):
            per_seed.append({**row, "seed": cells[i][5]})
            if (i + 1) % 10 == 0 or i + 1 == len(cells):
                progress(f"{i + 1}/{len(cells)} runs; last {row['mode']} {row['defence']} "
                         f"{row['scenario']}: acc {row['accuracy']:.3f}, "
                         f"success {row['success']:.3f} ({row['seconds']:.1f} s)")
    grid_s = time.perf_counter() - t0
    results: list[dict[str, Any]] = []  # means over the seeds
    for m in modes:
        for sc in SCENARIOS:
            for d in DEFENCES:
                rs = [r for r in per_seed if r["mode"] == m and r["defence"] == d
                      and r["scenario"] == sc.label]
                results.append({**rs[0], "seed": None,
                                "accuracy": float(np.mean([r["accuracy"] for r in rs])),
                                "success": float(np.mean([r["success"] for r in rs])),
                                "accuracy_per_seed": [r["accuracy"] for r in rs],
                                "success_per_seed": [r["success"] for r in rs]})

    def get(mode: str, defence: str, label: str) -> dict[str, Any]:
        return next(r for r in results if r["mode"] == mode and r["defence"] == defence
                    and r["scenario"] == label)

    report.note(
        f"{HONEST} honest clients (digits, Dirichlet {ALPHA}, data seed 0) plus the attackers "
        f"as extra identities; local training: {SETTINGS.local_epochs} epochs, batch "
        f"{SETTINGS.batch_size}, lr {SETTINGS.lr}, momentum {SETTINGS.momentum}. Sync: "
        f"{rounds} rounds of all identities (equal devices). Async: FedBuff, buffer {buffer}, "
        f"the same number of updates in total, device speeds spread {ASYNC_SPREAD:g}x "
        "(staleness = versions published while an identity trained). Every cell is a "
        "`Simulation` (the real `AggregatorCore`, `TorchTrainer`, codec and client rules, in "
        "virtual time); attacks go through its hooks: per-client `Attack`s from `make_attack`, "
        "a batch hook for Sybil floods, ALIE and IPM. Accuracy and attack success (test 1s "
        "classified as 7) "
        f"are means over the last {LAST} versions and over seeds {list(seeds)} (server, "
        "training and attacker seeds; the data split is fixed), in %; the test set "
        f"has {len(harness().test_y)} images (one accuracy point = "
        f"{len(harness().test_y) / 100:.1f} images), {int(harness().source_mask.sum())} of them "
        f"1s. Grid: {len(cells)} runs in {grid_s:.0f} s on {args.workers} processes.")
    if args.quick:
        report.note(f"Quick mode: {rounds} rounds instead of 15, one seed instead of two and a "
                    f"{agg_n}-update "
                    "aggregation timing; all defences, attacks and targets are the same as in "
                    "the full run, but the models are far from converged.")

    labels = [s.label for s in SCENARIOS]
    for mode in modes:
        rows = []
        for d in DEFENCES:
            row: dict[str, Any] = {"defence": d, "mode": mode}
            for lab in labels:
                r = get(mode, d, lab)
                sc = next(s for s in SCENARIOS if s.label == lab)
                row[lab] = (f"{_pct(r['accuracy'])} / {_pct(r['success'])}"
                            if sc.targeted or sc.attack == "none" else _pct(r["accuracy"]))
            rows.append(row)
        report.table(f"{mode}: clean accuracy % (no attack and targeted attacks: accuracy / "
                     "attack success %)",
                     [Column("defence", "defence")] + [Column(lab, lab) for lab in labels], rows)

    # -- targets (both modes) ------------------------------------------------------------
    for mode in modes:
        base = get(mode, "fedavg", "no attack")["accuracy"]
        d0 = get(mode, "default", "no attack")["accuracy"]
        report.target(f"{mode}: default, no attack, cost vs FedAvg", 100 * (base - d0), "<=",
                      0.5, unit="points",
                      detail=f"FedAvg {_pct(base)}, default {_pct(d0)}")
        succ = []
        for share in (0.1, 0.3, 0.5):
            r = get(mode, "default", f"sybil {share:.0%}")
            succ.append(r["success"])
            report.target(f"{mode}: default, Sybil {share:.0%}, attack success",
                          100 * r["success"], "<=", 5, unit="%",
                          detail=f"1s read as 7 with no attack: FedAvg "
                          f"{_pct(get(mode, 'fedavg', 'no attack')['success'])}, default "
                          f"{_pct(get(mode, 'default', 'no attack')['success'])}")
            report.target(f"{mode}: default, Sybil {share:.0%}, cost vs no-attack FedAvg",
                          100 * (base - r["accuracy"]), "<=", 1, unit="points",
                          detail=f"accuracy {_pct(r['accuracy'])}")
        rise = max(100 * (succ[1] - succ[0]), 100 * (succ[2] - succ[1]))
        report.target(f"{mode}: default, attack success never rises with more Sybils",
                      rise, "<=", 0, unit="points",
                      detail="largest rise 10->30->50 %: " + " / ".join(_pct(s) for s in succ))
        for attack in ("alie", "ipm"):
            r = get(mode, "default", f"{attack} 20%")
            report.target(f"{mode}: default, {attack.upper()} 20%, cost vs no-attack FedAvg",
                          100 * (base - r["accuracy"]), "<=", 3, unit="points",
                          detail=f"accuracy {_pct(r['accuracy'])}")

    # -- aggregation cost ----------------------------------------------------------------
    progress(f"timing aggregation: {agg_n} updates of {agg_p:,} parameters")
    cost = aggregation_cost(agg_n, agg_p)
    report.table(f"Aggregation cost: {agg_n} updates of {agg_p / 1e6:.0f} M float32 parameters",
                 [Column("rule", "rule"), Column("add_s", "add() all, s", "{:.2f}"),
                  Column("result_s", "result(), s", "{:.2f}")], cost)
    report.note(
        f"Aggregation cost: one `result()` per rule, in one process, after `add()` of {agg_n} "
        f"synthetic updates of {agg_p:,} values (weight 100 each, no staleness). "
        + ("" if agg_n >= 1000 else f"{agg_n} rather than 1,000 updates (quick mode); the "
           "buffered rules scale as O(nP), Krum's Gram matrix as O(n^2 P).")
        + f" Timing done with {len(os.sched_getaffinity(0))} CPUs, after the grid.",
        after_tables=True)
    report.note(
        "Async caveat: attackers are extra identities and the async run takes rounds x "
        "identities updates, so attacked async runs publish more versions (buffers of 10 "
        "updates) than the no-attack run. A defence that discards the attackers then applies "
        "the honest updates in smaller batches, i.e. more server steps, which on this "
        "not-yet-converged model can *raise* accuracy above the no-attack baseline (negative "
        "costs in the targets). Device speeds are drawn per identity (server seed), so a fast "
        "attacker pushes more often than a slow one. Sybil clones in async train from whatever "
        "version they pulled, so clones of different versions differ by more than their 5 % "
        "jitter.",
        after_tables=True)
    hist: dict[int, int] = {}
    for r in per_seed:
        if r["mode"] == "async" and r["scenario"] == "no attack" and r["defence"] == "fedavg":
            for k, v in r["staleness"].items():
                hist[int(k)] = hist.get(int(k), 0) + v
    if hist:
        n = sum(hist.values())
        report.note(
            f"Async staleness of the accepted updates (no attack, FedAvg, {n} updates): mean "
            f"{sum(k * v for k, v in hist.items()) / n:.2f}, max {max(hist)} versions; "
            + ", ".join(f"{k}: {v}" for k, v in sorted(hist.items())) + ".",
            after_tables=True)
    plot(report, results, modes)
    report.params["runs"] = per_seed
    return report.finish(save=not args.no_save)


if __name__ == "__main__":
    raise SystemExit(main())
