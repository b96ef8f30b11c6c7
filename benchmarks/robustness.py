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
  ``noise`` (Gaussian in place of the update, 5 x its norm), ``boost`` (label-flip update
  scaled by 5 = honest/attackers), ``backdoor`` (each attacker trains on its own random sample
  of the training set, half of it stamped with a 2x2 bottom-right pixel patch and relabelled
  7) and ``backdoor-boost`` (the same, update scaled by 5). Harness-level attacks are an
  ``update_hook`` over each training batch: ``sybil`` (k identities sending one
  label-flip-trained update per base version, each with 5 % jitter, ``sybil_clones``),
  ``sybil-switch`` (distinct identities training honestly on their own data for the first
  2/3 of the versions, then all sending one vector, -3 x the first one's update at the
  switch, with 5 % jitter each), ``alie`` (mean - z std of the latest honest updates,
  Baruch et al.'s z), ``ipm`` (-5 x their mean), ``min-max`` and ``min-sum`` (Shejwalkar and
  Houmansadr's optimised mean - gamma std). In sync runs the whole cohort trains in one batch,
  so the crowd attacks see the round's honest updates; in async runs they see each honest
  client's latest update (in flight or just pushed). Attackers are 20 % of identities (5 next
  to 20 honest); backdoors 10 and 20 %; Sybil floods 10 / 30 / 50 % (2, 9, 20 clones).
  Attackers hold the honest mean example count, and claim it.
* **defences** — registry names with their default options: ``fedavg`` (none), ``clip``,
  ``median``, ``trimmed-mean``, ``krum`` (f=1), ``multi-krum`` (f=1), ``centered-clip``,
  ``flame``, ``dnc``, ``sybil``, ``sybil-cclip`` (the default until issue 12) and ``default``.
* **metrics** — clean accuracy on the 359-image test set and attack success, each the mean
  over the last 3 global versions: for backdoors, the share of triggered test images of other
  classes classified as 7; otherwise the share of test 1s classified as 7. For trust-building
  Sybils, the number of versions holding a switched Sybil's update in which one still had a
  Sybil weight above 0.05 (rules with Sybil weights only).

A second part times ``result()`` of each rule for n updates of a 1 M-parameter model, and
``default`` against ``sybil-cclip`` (the 2x target).

Targets hold on the worst seed: each is computed per seed (costs against the same seed's
no-attack FedAvg) and the worst value is reported; the tables show means over the seeds.

Run: ``python benchmarks/robustness.py [--quick | --smoke] [--seeds 0 1]``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Column, Report, parse_args, progress, pyplot  # noqa: E402
from murmura.aggregation import create_aggregator  # noqa: E402
from murmura.client.attacks import (  # noqa: E402
    add_trigger,
    alie,
    corner_trigger,
    ipm,
    min_max,
    min_sum,
    sign_flip,
    sybil_clones,
)
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
DEFENCES = ["fedavg", "clip", "median", "trimmed-mean", "krum", "multi-krum", "centered-clip",
            "flame", "dnc", "sybil", "sybil-cclip", "default"]
#: --quick runs these defences and the scenarios that have targets, with the full run's rounds
#: and both seeds (every target is judged on the worst seed), so its targets are the full
#: run's cells, the same numbers: 156 runs of 2-5 CPU-s each, about 4 minutes on 2 cores.
#: (At 12 rounds FedAvg was still climbing, at 93.6%, and quick missed a cost target the full
#: run met.)
QUICK_DEFENCES = ["fedavg", "sybil-cclip", "default"]
FULL_ROUNDS = 20
#: --smoke: every scenario the targets need, the two defences they compare, one seed and 2
#: rounds (the trust-building Sybils switch at version 1), aggregation timed on toy updates
#: and one local epoch (every scenario runs: the per-client attacks are set up in this script)
SMOKE_DEFENCES, SMOKE_ROUNDS, SMOKE_AGG = ["fedavg", "default"], 2, (12, 10_000)
SEEDS = (0, 1)  # server, training and attacker seeds (quick and full); the data split is fixed
SETTINGS = TaskSettings(local_epochs=3, batch_size=16, lr=0.3, momentum=0.5)
SIGN_SCALE, NOISE_MULT, BOOST, IPM_EPS, JITTER = 3.0, 5.0, 5.0, 5.0, 0.05
BACKDOOR_FRACTION, PATCH = 0.5, 2  # share of an attacker's images stamped, trigger side (pixels)
SWITCH_AT = 2 / 3  # trust-building Sybils turn malicious after this share of the versions
LOST = 0.05  # a Sybil weight at or below this counts as lost
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
    Scenario("backdoor", 0.1, True),
    Scenario("backdoor", 0.2, True),
    Scenario("backdoor-boost", 0.1, True),
    Scenario("backdoor-boost", 0.2, True),
    Scenario("sybil", 0.1, True),
    Scenario("sybil", 0.3, True),
    Scenario("sybil", 0.5, True),
    Scenario("sybil-switch", 0.2),
    Scenario("alie", 0.2),
    Scenario("ipm", 0.2),
    Scenario("min-max", 0.2),
    Scenario("min-sum", 0.2),
]
QUICK_SCENARIOS = [s for s in SCENARIOS
                   if s.attack not in ("label-flip", "sign-flip", "noise", "boost")]


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
        self.trigger = corner_trigger(test.x.shape[1], size=PATCH)
        stamped = test.y != TARGET
        self.triggered_x = torch.from_numpy(add_trigger(test.x[stamped], self.trigger))

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

    def own_share(self, i: int) -> np.ndarray:
        """Attacker ``i``'s own data for backdoors and trust-building Sybils: ``mean_n``
        training images drawn at random (a distinct sample per attacker)."""
        rng = np.random.default_rng([11, i])
        return rng.choice(len(self.task.train), size=self.mean_n, replace=False)

    def metrics(self, params: np.ndarray) -> tuple[float, float, float]:
        """Clean accuracy, label-flip success (test 1s read as 7) and backdoor success
        (triggered test images of other classes read as 7)."""
        self.spec.load_into(self.probe, params)
        self.probe.eval()
        with torch.no_grad():
            pred = self.probe(self.test_x).argmax(dim=1).numpy()
            trig = self.probe(self.triggered_x).argmax(dim=1).numpy()
        acc = float(np.mean(pred == self.test_y))
        asr = float(np.mean(pred[self.source_mask] == TARGET))
        return acc, asr, float(np.mean(trig == TARGET))


_HARNESS: Harness | None = None


def harness() -> Harness:
    global _HARNESS
    if _HARNESS is None:
        _HARNESS = Harness()
    return _HARNESS


# -- harness-level attacks: engine update hooks ---------------------------------------------


class CrowdAttack:
    """ALIE / IPM / Min-Max / Min-Sum: every attacker in a batch sends one vector built from
    the latest update of each honest client (sync: the round's honest updates, which train in
    the attackers' batch; async: the honest updates in flight or just pushed)."""

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
        elif self.kind == "min-max":
            v = min_max(honest)
        elif self.kind == "min-sum":
            v = min_sum(honest)
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


class SybilSwitch:
    """Trust-building Sybils: distinct identities that train honestly on their own data until
    base version ``switch``, then all send one malicious vector (-3 x the first Sybil's update
    at the switch, each push with its own 5 % jitter)."""

    def __init__(self, seed: int, switch: int) -> None:
        self.rng = np.random.default_rng([seed, 98])
        self.switch = switch
        self.poison: np.ndarray | None = None
        self.switched = False  # a malicious update has been trained

    def __call__(self, batch: UpdateBatch) -> dict[int, np.ndarray]:
        out = {}
        for c, version, u in zip(batch.clients, batch.versions, batch.updates, strict=True):
            if c >= HONEST and version >= self.switch:
                if self.poison is None:
                    self.poison = sign_flip(u, scale=SIGN_SCALE)
                out[c] = sybil_clones(self.poison, k=1, jitter=JITTER, rng=self.rng)[0]
                self.switched = True
        return out


def scenario_attacks(sc: Scenario, seed: int, versions: int = 1
                     ) -> tuple[dict[int, Attack], BatchHook | None]:
    """The per-client attacks (what a deployed malicious client runs, ``make_attack``) and the
    harness hook of one scenario; attackers are clients ``HONEST`` onwards."""
    attackers = range(HONEST, HONEST + sc.attackers)
    flip = make_attack("label-flip", {"source": str(SOURCE), "target": str(TARGET)})
    if sc.attack.startswith("backdoor"):
        boost = BOOST if sc.attack == "backdoor-boost" else 1.0
        return {c: make_attack("backdoor", {"target": str(TARGET), "patch": str(PATCH),
                                            "fraction": str(BACKDOOR_FRACTION),
                                            "boost": str(boost)}, seed=seed * 1000 + c)
                for c in attackers}, None
    if sc.attack == "sybil-switch":
        return {}, SybilSwitch(seed, max(1, math.floor(SWITCH_AT * versions)))
    if sc.attack in ("none", "alie", "ipm", "min-max", "min-sum"):
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


def run_cell(args: tuple[str, Scenario, str, int, int, int, TaskSettings]) -> dict[str, Any]:
    """One (defence, scenario, mode, seed) cell: a :class:`Simulation` of the honest clients
    and the attackers, with the attacks injected through the engine's hooks."""
    defence, sc, mode, rounds, buffer, seed, settings = args
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
    server = prepare_server(ServerConfig.from_flat(
        mode=mode, max_versions=versions, min_clients=total, cohort_fraction=1.0,
        buffer_size=buffer, max_staleness=50, defense=defence, seed=seed, train=settings), sim)
    own = sc.attack.startswith("backdoor") or sc.attack == "sybil-switch"
    shares = h.shares + [h.own_share(j) if own else
                         h.attacker_share(0 if sc.attack == "sybil" else j) for j in range(k)]
    data = SimulationData(h.task, shares, f"{h.task_config.task} (bundled) + {k} attackers")
    attacks, hook = scenario_attacks(sc, seed, versions)
    history: list[np.ndarray] = []
    engine: Simulation | None = None
    sybil_ids: set[str] = set()
    kept: list[float] = []  # after the switch: the largest Sybil weight in each version

    def on_version(_: dict[str, Any]) -> None:
        assert engine is not None
        history.append(engine.core.params.copy())
        rule = engine.core.policy.aggregator
        if isinstance(hook, SybilSwitch) and hook.poison is not None and hasattr(rule, "scorer"):
            # Malicious Sybil rows of this version: Sybil ids whose update points along the
            # poison (cosine > 0.9 on the rule's own sketches; honest updates are far below).
            ps = rule.scorer.sketch(hook.poison)
            sk = rule._sketches
            cos = sk @ ps / np.maximum(np.linalg.norm(sk, axis=1) * np.linalg.norm(ps), 1e-30)
            ws = [w for i, w, c in zip(rule.last_ids, rule.last_weights, cos, strict=True)
                  if i in sybil_ids and c > 0.9]
            if ws:
                kept.append(float(max(ws)))

    engine = Simulation(h.task_config, server, sim, data=data, out_dir=None, evaluate=False,
                        progress=on_version, attacks=attacks, update_hook=hook)
    sybil_ids.update(engine.ids[HONEST:])
    result = engine.run()
    m = np.array([h.metrics(p) for p in history[-LAST:]])
    backdoor = sc.attack.startswith("backdoor")
    # Versions holding a malicious Sybil update in which one still had weight > LOST.
    lag = sum(1 for w in kept if w > LOST) if kept else None
    return {"defence": defence, "attack": sc.attack, "share": sc.share, "scenario": sc.label,
            "targeted": sc.targeted, "attackers": k, "mode": mode,
            "accuracy": float(m[:, 0].mean()),
            "success": float(m[:, 2 if backdoor else 1].mean()),
            "backdoor_success": float(m[:, 2].mean()),
            "sybil_weights_after_switch": kept, "sybil_lag": lag,
            "versions": result.version, "seconds": time.perf_counter() - t0,
            "staleness": {str(s): n for s, n in sorted(result.staleness.items())},
            "refused": result.summary["simulation"]["refused"]}


# -- aggregation cost ----------------------------------------------------------------------


def aggregation_cost(n: int, p: int, rules: list[str]) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal(p, dtype=np.float32) * np.float32(0.01)
    stack = rng.standard_normal((n, p), dtype=np.float32)
    stack *= np.float32(0.01)
    stack += base
    updates = list(stack)
    rows = []
    for rule in rules:
        agg = create_aggregator(rule, p)
        t0 = time.perf_counter()
        for i, u in enumerate(updates):
            agg.add(u, 100.0, client_id=f"c{i}")
        t_add = time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.process_time()
        out = agg.result()
        t_res, c_res = time.perf_counter() - t0, time.process_time() - c0
        assert out.shape == (p,) and np.all(np.isfinite(out))
        rows.append({"rule": rule, "n": n, "params": p, "add_s": t_add, "result_s": t_res,
                     "result_cpu_s": c_res})
        progress(f"aggregation cost {rule}: add {t_add:.2f} s, result {t_res:.2f} s "
                 f"({c_res:.2f} CPU-s)")
        del agg, out
    return rows


# -- the report ----------------------------------------------------------------------------


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def plot(report: Report, results: list[dict[str, Any]], modes: list[str],
         defences: list[str], scenarios: list[Scenario]) -> None:
    plt = pyplot()
    labels = [s.label for s in scenarios]
    fig, axes = plt.subplots(2, len(modes), figsize=(9 * len(modes), 9), squeeze=False)
    for c, mode in enumerate(modes):
        for r, (key, title, cmap) in enumerate([("accuracy", "clean accuracy (%)", "viridis"),
                                               ("success", "attack success (%)", "magma_r")]):
            grid = np.full((len(defences), len(labels)), np.nan)
            for row in results:
                if row["mode"] == mode:
                    grid[defences.index(row["defence"]), labels.index(row["scenario"])] = \
                        100 * row[key]
            ax = axes[r][c]
            im = ax.imshow(grid, cmap=cmap, vmin=0, vmax=100, aspect="auto")
            ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
            ax.set_yticks(range(len(defences)), defences, fontsize=8)
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
        p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                       help="server/training/attacker seeds (default 0 1; targets: worst seed)")
        p.add_argument("--agg-updates", type=int, default=None,
                       help="updates timed per rule at 1 M parameters (default 1000; quick 200)")

    args = parse_args(NAME, __doc__.splitlines()[0], argv, extra)
    torch.set_num_threads(1)
    rounds = FULL_ROUNDS
    buffer = 10
    seeds = tuple(dict.fromkeys(args.seeds))
    defences = QUICK_DEFENCES if args.quick else DEFENCES
    scenarios = QUICK_SCENARIOS if args.quick else SCENARIOS
    agg_n = args.agg_updates or (200 if args.quick else 1000)
    agg_p = 1_000_000
    settings = SETTINGS
    if args.smoke:
        settings = replace(SETTINGS, local_epochs=1)
        rounds, defences, seeds = SMOKE_ROUNDS, SMOKE_DEFENCES, seeds[:1]
        agg_n, agg_p = args.agg_updates or SMOKE_AGG[0], SMOKE_AGG[1]
    modes = ["sync", "async"]
    report = Report(NAME, quick=args.quick, params={
        "honest_clients": HONEST, "alpha": ALPHA, "rounds": rounds, "async_buffer": buffer,
        "seeds": list(seeds), "settings": repr(settings), "defences": defences,
        "scenarios": [s.label for s in scenarios], "source": SOURCE, "target": TARGET,
        "sign_scale": SIGN_SCALE, "noise_mult": NOISE_MULT, "boost": BOOST, "ipm_eps": IPM_EPS,
        "sybil_jitter": JITTER, "async_speed_spread": ASYNC_SPREAD,
        "backdoor_fraction": BACKDOOR_FRACTION, "trigger_patch": PATCH, "switch_at": SWITCH_AT,
        "aggregation_updates": agg_n, "aggregation_params": agg_p})
    cells = [(d, s, m, rounds, buffer, seed, settings) for seed in seeds for m in modes
             for s in scenarios for d in defences]
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
        for sc in scenarios:
            for d in defences:
                rs = [r for r in per_seed if r["mode"] == m and r["defence"] == d
                      and r["scenario"] == sc.label]
                results.append({**rs[0], "seed": None,
                                "accuracy": float(np.mean([r["accuracy"] for r in rs])),
                                "success": float(np.mean([r["success"] for r in rs])),
                                "sybil_lag": (max(r["sybil_lag"] for r in rs)
                                              if rs[0]["sybil_lag"] is not None else None),
                                "accuracy_per_seed": [r["accuracy"] for r in rs],
                                "success_per_seed": [r["success"] for r in rs],
                                "backdoor_success_per_seed": [r["backdoor_success"]
                                                              for r in rs]})

    def get(mode: str, defence: str, label: str) -> dict[str, Any]:
        return next(r for r in results if r["mode"] == mode and r["defence"] == defence
                    and r["scenario"] == label)

    def seeds_of(mode: str, defence: str, label: str, key: str) -> np.ndarray:
        """``key`` per seed, in ``seeds`` order (targets are judged on the worst one)."""
        return np.array(get(mode, defence, label)[f"{key}_per_seed"])

    def per_seed_pct(values: np.ndarray) -> str:
        return " / ".join(_pct(v) for v in values) + f" (seeds {', '.join(map(str, seeds))})"

    report.note(
        f"{HONEST} honest clients (digits, Dirichlet {ALPHA}, data seed 0) plus the attackers "
        f"as extra identities; local training: {settings.local_epochs} epochs, batch "
        f"{settings.batch_size}, lr {settings.lr}, momentum {settings.momentum}. Sync: "
        f"{rounds} rounds of all identities (equal devices). Async: FedBuff, buffer {buffer}, "
        f"the same number of updates in total, device speeds spread {ASYNC_SPREAD:g}x "
        "(staleness = versions published while an identity trained). Every cell is a "
        "`Simulation` (the real `AggregatorCore`, `TorchTrainer`, codec and client rules, in "
        "virtual time); attacks go through its hooks: per-client `Attack`s from `make_attack`, "
        "a batch hook for Sybil floods, ALIE and IPM. Accuracy and attack success (test 1s "
        "classified as 7) "
        f"are means over the last {LAST} versions, in %; the tables show means over seeds "
        f"{list(seeds)} (server, training and attacker seeds; the data split is fixed) and "
        "every target is judged on the worst seed (costs against the same seed's no-attack "
        "FedAvg), with the per-seed values in its detail; the test set "
        f"has {len(harness().test_y)} images (one accuracy point = "
        f"{len(harness().test_y) / 100:.1f} images), {int(harness().source_mask.sum())} of them "
        f"1s. Grid: {len(cells)} runs in {grid_s:.0f} s on {args.workers} processes.")
    if args.quick:
        report.note(f"Quick mode: the full run's {rounds} rounds and seeds, the defences "
                    f"{', '.join(defences)} instead of all {len(DEFENCES)}, the scenarios "
                    "that have targets (not the label-flip, sign-flip, noise and boost "
                    f"columns), and a {agg_n}-update aggregation timing. Every accuracy and "
                    "attack target is therefore computed from the same cells as in the full "
                    "run; only the aggregation timing is smaller.")

    labels = [s.label for s in scenarios]
    for mode in modes:
        rows = []
        for d in defences:
            row: dict[str, Any] = {"defence": d, "mode": mode}
            for lab in labels:
                r = get(mode, d, lab)
                sc = next(s for s in SCENARIOS if s.label == lab)
                row[lab] = (f"{_pct(r['accuracy'])} / {_pct(r['success'])}"
                            if sc.targeted or sc.attack == "none" else _pct(r["accuracy"]))
                if sc.attack == "sybil-switch" and r["sybil_lag"] is not None:
                    row[lab] += f" (lag {r['sybil_lag']})"
            rows.append(row)
        report.table(f"{mode}: clean accuracy % (no attack and targeted attacks: accuracy / "
                     "attack success %; sybil-switch: versions in which a switched Sybil kept "
                     "weight, for the Sybil-weighting rules)",
                     [Column("defence", "defence")] + [Column(lab, lab) for lab in labels], rows)

    # -- targets (both modes), each on the worst seed -------------------------------------
    for mode in modes:
        base = seeds_of(mode, "fedavg", "no attack", "accuracy")  # per seed

        def cost(defence: str, label: str, mode: str = mode,
                 base: np.ndarray = base) -> tuple[float, str]:
            acc = seeds_of(mode, defence, label, "accuracy")
            return (float(100 * np.max(base - acc)),
                    f"accuracy {per_seed_pct(acc)}; FedAvg no attack {per_seed_pct(base)}")

        value, detail = cost("default", "no attack")
        report.target(f"{mode}: default, no attack, cost vs FedAvg (worst seed)", value, "<=",
                      0.5, unit="points", detail=detail)
        succ = []
        for share in (0.1, 0.3, 0.5):
            label = f"sybil {share:.0%}"
            s = seeds_of(mode, "default", label, "success")
            succ.append(s)
            report.target(f"{mode}: default, Sybil {share:.0%}, attack success (worst seed)",
                          float(100 * s.max()), "<=", 5, unit="%",
                          detail=f"per seed {per_seed_pct(s)}; 1s read as 7 with no attack: "
                          f"FedAvg {per_seed_pct(seeds_of(mode, 'fedavg', 'no attack', 'success'))}"
                          f", default "
                          f"{per_seed_pct(seeds_of(mode, 'default', 'no attack', 'success'))}")
            value, detail = cost("default", label)
            report.target(f"{mode}: default, Sybil {share:.0%}, cost vs no-attack FedAvg "
                          "(worst seed)", value, "<=", 1, unit="points", detail=detail)
        rise = float(100 * max(np.max(succ[1] - succ[0]), np.max(succ[2] - succ[1])))
        report.target(f"{mode}: default, attack success never rises with more Sybils "
                      "(worst seed)", rise, "<=", 0, unit="points",
                      detail="largest rise 10->30->50 % on any seed; "
                      + "; ".join(f"seed {sd}: " + " / ".join(_pct(v[i]) for v in succ)
                                  for i, sd in enumerate(seeds)))
        for attack in ("alie", "ipm", "min-max", "min-sum"):
            value, detail = cost("default", f"{attack} 20%")
            report.target(f"{mode}: default, {attack.upper()} 20%, cost vs no-attack FedAvg "
                          "(worst seed)", value, "<=", 3, unit="points", detail=detail)
        for attack in ("backdoor", "backdoor-boost"):
            for share in (0.1, 0.2):
                label = f"{attack} {share:.0%}"
                s = seeds_of(mode, "default", label, "success")
                f = seeds_of(mode, "fedavg", label, "success")
                clean = seeds_of(mode, "default", "no attack", "backdoor_success")
                report.target(f"{mode}: default, {label}, backdoor success (worst seed)",
                              float(100 * s.max()), "<=", 5, unit="%",
                              detail=f"per seed {per_seed_pct(s)}; FedAvg {per_seed_pct(f)}; "
                              f"triggered images read as {TARGET} with no attack: default "
                              f"{per_seed_pct(clean)}")
        r = get(mode, "default", "sybil-switch 20%")
        report.target(f"{mode}: default, trust-building Sybils 20%, versions they keep weight "
                      "after switching (worst seed)",
                      float(r["sybil_lag"] if r["sybil_lag"] is not None else math.inf), "<=",
                      2, unit="versions",
                      detail=f"accuracy {per_seed_pct(np.array(r['accuracy_per_seed']))}")

    # -- aggregation cost ----------------------------------------------------------------
    progress(f"timing aggregation: {agg_n} updates of {agg_p:,} parameters")
    rules = list(dict.fromkeys(defences + ["multi-krum", "sybil-cclip", "default"]))
    cost = aggregation_cost(agg_n, agg_p, rules)
    # The 2x target: today's default composition (sybil-cclip) against the new default,
    # timed alternately twice more so that a noisy neighbour hits both alike; medians of 3.
    pair = [r for r in cost if r["rule"] in ("sybil-cclip", "default")]
    for _ in range(2):
        pair += aggregation_cost(agg_n, agg_p, ["sybil-cclip", "default"])
    med = {k: float(np.median([r["result_s"] for r in pair if r["rule"] == k]))
           for k in ("sybil-cclip", "default")}
    cpu = {k: float(np.median([r["result_cpu_s"] for r in pair if r["rule"] == k]))
           for k in ("sybil-cclip", "default")}
    report.target(f"default result() for {agg_n} updates of {agg_p / 1e6:g} M, vs sybil-cclip "
                  "(the previous "
                  "default)", med["default"] / med["sybil-cclip"], "<=", 2, unit="x",
                  detail=f"median of 3: default {med['default']:.2f} s, sybil-cclip "
                  f"{med['sybil-cclip']:.2f} s; CPU time (all threads) {cpu['default']:.2f} "
                  f"vs {cpu['sybil-cclip']:.2f} CPU-s, "
                  f"{cpu['default'] / cpu['sybil-cclip']:.2f}x")
    report.table(f"Aggregation cost: {agg_n} updates of {agg_p / 1e6:.0f} M float32 parameters",
                 [Column("rule", "rule"), Column("add_s", "add() all, s", "{:.2f}"),
                  Column("result_s", "result(), s", "{:.2f}"),
                  Column("result_cpu_s", "result(), CPU-s", "{:.2f}")], cost)
    report.note(
        f"Aggregation cost: one `result()` per rule, in one process, after `add()` of {agg_n} "
        f"synthetic updates of {agg_p:,} values (weight 100 each, no staleness); wall time "
        "and CPU time of the process (all threads: the selection rules use two). "
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
    plot(report, results, modes, defences, scenarios)
    report.params["runs"] = per_seed
    return report.finish(save=not args.no_save)


if __name__ == "__main__":
    raise SystemExit(main())
