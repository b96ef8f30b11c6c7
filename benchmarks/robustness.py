"""Robust aggregation under attack: accuracy and targeted-attack success for every defence.

One grid, the same clients, split, seeds and attackers for every cell:

* **task** — digits, the bundled MLP, 20 honest clients with a Dirichlet(0.5) label split
  (data seed 0). Attackers are *extra* identities joined next to the 20 honest ones, so every
  scenario keeps the same honest data and the no-attack FedAvg run is a fair baseline.
* **driver** — the real :class:`~murmura.server.AggregatorCore` (built by ``build_core``),
  driven in-process: ``core.task`` -> ``core.model`` -> local ``TorchTrainer`` training ->
  delta -> attack -> dense-f32 payload -> ``core.push(UpdateHeader, payload)``. The simulation
  engine has no hook for per-client update transforms, hence this driver. In ``sync`` mode all
  identities train every round. In ``async`` mode (FedBuff, ``buffer_size`` updates per
  version) identities push in a seeded random order; each one pulls the then-current model
  after pushing, so its next update arrives with the staleness of however many versions were
  published meanwhile. Async runs take as many updates in total as sync runs.
* **attacks** (``client/attacks.py``; the attacked class pair is 1 -> 7):
  ``label-flip`` (attackers train on data half of which is 1s relabelled 7), ``sign-flip``
  (-3 x own honest update), ``noise`` (Gaussian in place of the update, 5 x its norm),
  ``boost`` (label-flip update scaled by 5 = honest/attackers), ``sybil`` (k identities
  sending one label-flip-trained update, each with 5 % jitter, ``sybil_clones``), ``alie``
  (mean - z std of the honest updates of the same round, Baruch et al.'s z) and ``ipm``
  (-5 x the honest mean). Byzantine attackers are 20 % of identities (5 next to 20 honest);
  Sybils 10 / 30 / 50 % (2, 9, 20 clones). Attackers claim the honest mean example count.
  ALIE / IPM attackers see the honest updates of the round (async: the honest updates in
  flight).
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
from murmura.client import TorchTrainer  # noqa: E402
from murmura.client.attacks import (  # noqa: E402
    alie,
    gaussian_noise,
    ipm,
    scale_update,
    sign_flip,
    sybil_clones,
)
from murmura.protocols import Action, DeviceProfile, TaskSettings, UpdateHeader  # noqa: E402
from murmura.server import ServerConfig, ServiceError, build_core  # noqa: E402
from murmura.tasks import ArrayDataset, TaskConfig, load_task  # noqa: E402

NAME = "robustness"
HONEST = 20
ALPHA = 0.5
SOURCE, TARGET = 1, 7
DEFENCES = ["fedavg", "clip", "median", "trimmed-mean", "krum", "centered-clip", "sybil",
            "default"]
SETTINGS = TaskSettings(local_epochs=2, batch_size=16, lr=0.1, momentum=0.5)
SIGN_SCALE, NOISE_MULT, BOOST, IPM_EPS, JITTER = 3.0, 5.0, 5.0, 5.0, 0.05
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
    """The task, honest trainers and attacker data, shared by every run in one process."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.task_config = TaskConfig(task="digits", model="mlp", partition="dirichlet",
                                      alpha=ALPHA, data_seed=0)
        self.task = load_task(self.task_config)
        self.shares = [self.task.client_data(i, HONEST) for i in range(HONEST)]
        self.mean_n = int(round(np.mean([len(s) for s in self.shares])))
        self.honest = [TorchTrainer(self.task.build_model(), s, device="cpu")
                       for s in self.shares]
        self.probe = self.task.build_model()
        test = self.task.test
        self.test_x = torch.from_numpy(test.x)
        self.test_y = test.y
        self.source_mask = test.y == SOURCE

    def attacker_data(self, i: int, flipped: bool) -> ArrayDataset:
        """Attacker ``i``'s data: half source-class images (relabelled as the target when
        ``flipped``), half other training images, ``mean_n`` in all."""
        train = self.task.train
        rng = np.random.default_rng([7, i])
        src = np.flatnonzero(train.y == SOURCE)
        rest = np.flatnonzero(train.y != SOURCE)
        half = self.mean_n // 2
        idx = np.concatenate([rng.choice(src, size=min(half, len(src)), replace=False),
                              rng.choice(rest, size=self.mean_n - half, replace=False)])
        y = train.y[idx].copy()
        if flipped:
            y[y == SOURCE] = TARGET
        return ArrayDataset(train.x[idx].copy(), y)

    def metrics(self, params: np.ndarray) -> tuple[float, float]:
        spec = self.honest[0].spec
        spec.load_into(self.probe, params)
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


def _payload(delta: np.ndarray) -> bytes:
    return np.asarray(delta, "<f4").tobytes()


class Run:
    """One (defence, scenario, mode) cell."""

    def __init__(self, defence: str, sc: Scenario, mode: str, rounds: int, buffer: int,
                 seed: int) -> None:
        self.h = harness()
        self.sc, self.mode, self.seed = sc, mode, seed
        k = sc.attackers
        self.k = k
        total = HONEST + k
        if mode == "sync":
            versions = rounds
        else:  # as many updates as the sync run takes
            versions = max(1, math.ceil(rounds * total / buffer))
        cfg = ServerConfig(mode=mode, max_versions=versions, min_clients=total,
                           cohort_fraction=1.0, buffer_size=buffer, max_staleness=50,
                           defense=defence, seed=seed, train=SETTINGS)
        self.core = build_core(cfg, self.task_config, out_dir=None, evaluate=False)
        self.settings = self.core.config.train
        self.ids = [f"honest-{i:02d}" for i in range(HONEST)] + [f"attacker-{j:02d}"
                                                                 for j in range(k)]
        self.sessions = {cid: self.core.join(cid, DeviceProfile()).session for cid in self.ids}
        flipped = sc.attack in ("label-flip", "boost", "sybil")
        self.attack_trainers = []
        if k and sc.attack not in ("alie", "ipm"):
            n_trainers = 1 if sc.attack == "sybil" else k
            self.attack_trainers = [TorchTrainer(self.h.task.build_model(),
                                                 self.h.attacker_data(j, flipped), device="cpu")
                                    for j in range(n_trainers)]
        self.rng = np.random.default_rng([seed, 99])
        self.sybil_cache: dict[int, np.ndarray] = {}
        self.history: list[np.ndarray] = []
        self.uid = 0

    @property
    def task_config(self) -> TaskConfig:
        return harness().task_config

    # -- updates -----------------------------------------------------------------------

    def honest_delta(self, i: int, base: np.ndarray, seed: int) -> np.ndarray:
        res = self.h.honest[i].train(base, self.settings, seed=seed)
        return np.subtract(res.params, base, dtype=np.float32)

    def own_delta(self, j: int, base: np.ndarray, seed: int) -> np.ndarray:
        res = self.attack_trainers[j].train(base, self.settings, seed=seed)
        return np.subtract(res.params, base, dtype=np.float32)

    def attacker_delta(self, j: int, base: np.ndarray, version: int, seed: int,
                       honest: list[np.ndarray]) -> np.ndarray:
        a = self.sc.attack
        if a == "alie":
            return alie(np.stack(honest), num_clients=HONEST + self.k, num_byzantine=self.k)
        if a == "ipm":
            return ipm(np.stack(honest), eps=IPM_EPS)
        if a == "sybil":  # one poisoned objective per base version, cloned with jitter
            if version not in self.sybil_cache:
                self.sybil_cache = {version: self.own_delta(0, base, seed=self.seed * 1000
                                                            + version)}
            return sybil_clones(self.sybil_cache[version], k=1, jitter=JITTER, rng=self.rng)[0]
        d = self.own_delta(j, base, seed)
        if a == "label-flip":
            return d
        if a == "boost":
            return scale_update(d, factor=BOOST)
        if a == "sign-flip":
            return sign_flip(d, scale=SIGN_SCALE)
        if a == "noise":
            std = NOISE_MULT * float(np.linalg.norm(d)) / math.sqrt(d.size)
            return gaussian_noise(d, std=std, rng=self.rng)
        raise ValueError(a)

    def push(self, cid: str, delta: np.ndarray, base_version: int, rnd: int) -> None:
        payload = _payload(delta)
        self.uid += 1
        header = UpdateHeader(session=self.sessions[cid], update_id=f"u{self.uid}",
                              base_version=base_version, round=rnd,
                              num_examples=self.h.mean_n if cid.startswith("attacker")
                              else len(self.h.shares[int(cid.split("-")[1])]),
                              codec="dense-f32", payload_bytes=len(payload))
        before = self.core.version
        self.core.push(header, payload, wire_bytes=len(payload))
        if self.core.version != before:
            self.history.append(np.array(self.core.params, copy=True))

    # -- modes ---------------------------------------------------------------------------

    def run_sync(self) -> None:
        core = self.core
        while not core.done:
            tasks = {cid: core.task(self.sessions[cid]) for cid in self.ids}
            if any(t.action != Action.TRAIN for t in tasks.values()):
                break
            version, params = core.model(self.sessions[self.ids[0]])
            base = np.array(params, copy=True)
            rnd = tasks[self.ids[0]].round
            honest = [self.honest_delta(i, base, tasks[self.ids[i]].seed) for i in range(HONEST)]
            deltas = dict(zip(self.ids[:HONEST], honest, strict=True))
            for j, cid in enumerate(self.ids[HONEST:]):
                deltas[cid] = self.attacker_delta(j, base, version, tasks[cid].seed, honest)
            for cid in self.ids:
                self.push(cid, deltas[cid], version, rnd)

    def run_async(self) -> None:
        core = self.core
        # in flight: cid -> (base version, base params, delta or None for ALIE/IPM, seed)
        flight: dict[str, tuple[int, np.ndarray, np.ndarray | None, int]] = {}

        def pull(cid: str) -> bool:
            t = core.task(self.sessions[cid])
            if t.action != Action.TRAIN:
                return False
            version, params = core.model(self.sessions[cid])
            base = np.array(params, copy=True)
            if cid.startswith("honest"):
                delta = self.honest_delta(int(cid.split("-")[1]), base, t.seed)
            elif self.sc.attack in ("alie", "ipm"):
                delta = None  # built at push time from the honest updates in flight
            else:
                delta = self.attacker_delta(int(cid.split("-")[1]), base, version, t.seed, [])
            flight[cid] = (version, base, delta, t.seed)
            return True

        for cid in self.rng.permutation(self.ids):
            pull(str(cid))
        while not core.done:
            cid = str(self.rng.choice(self.ids))
            version, base, delta, seed = flight[cid]
            if delta is None:
                honest = [flight[h][2] for h in self.ids[:HONEST]]
                delta = self.attacker_delta(0, base, version, seed, honest)
            try:
                self.push(cid, delta, version, 0)
            except ServiceError:  # too stale: train again on the current model
                pass
            if not core.done and not pull(cid):
                break

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.run_sync() if self.mode == "sync" else self.run_async()
        last = self.history[-LAST:]
        m = np.array([self.h.metrics(p) for p in last])
        return {"accuracy": float(m[:, 0].mean()), "success": float(m[:, 1].mean()),
                "versions": self.core.version, "seconds": time.perf_counter() - t0}


def run_cell(args: tuple[str, Scenario, str, int, int, int]) -> dict[str, Any]:
    defence, sc, mode, rounds, buffer, seed = args
    out = Run(defence, sc, mode, rounds, buffer, seed).run()
    return {"defence": defence, "attack": sc.attack, "share": sc.share, "scenario": sc.label,
            "targeted": sc.targeted, "attackers": sc.attackers, "mode": mode, **out}


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
        "sybil_jitter": JITTER, "aggregation_updates": agg_n, "aggregation_params": agg_p})
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
        f"{rounds} rounds of all identities. Async: FedBuff, buffer {buffer}, the same number "
        "of updates in total, identities arriving in a seeded random order (staleness = "
        "versions published while an identity trained). Every cell drives the real "
        "`AggregatorCore` in-process. Accuracy and attack success (test 1s classified as 7) "
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
        "costs in the targets). Sybil clones in async train from whatever version they pulled, "
        "so clones of different versions differ by more than their 5 % jitter.",
        after_tables=True)
    plot(report, results, modes)
    report.params["runs"] = per_seed
    return report.finish(save=not args.no_save)


if __name__ == "__main__":
    raise SystemExit(main())
