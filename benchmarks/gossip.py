"""Gossip mode: Epidemic Learning and MoDeST-style sampling against server FedAvg, under churn
and Sybil floods, on the simulator; and real peers on loopback.

* **Epidemic** (``s = ceil(log2 n)``, EL-Local over bounded views): digits, Dirichlet 0.5, at
  n = 100; at n = 1,000 the bundled digits (1,438 training images) cannot give every peer two
  examples, so that row uses the synthetic task (50 examples per peer, Dirichlet 0.5). The
  baseline is the server's sync FedAvg over all clients with the same rounds and the same
  local work (one epoch of SGD per round), the same data split and starting model. Accuracy
  is the mean test accuracy of the peers' own models. Bytes are counted as a deployed peer
  puts them on the wire (header and framed chunks of each PushModel).
* **MoDeST-style** (20 trainers and 3 aggregators per round: the first online peers in a
  hash ranking of the peers seen in the previous round; a trainer without the latest
  aggregate pulls it from an aggregator that made it): against sync FedAvg with a cohort of
  20, 30 rounds; then with 50 % of the peers offline every round, and with 80 % crashing at
  mid-run; accuracy is that of the round's aggregate, mean of the last 3 rounds.
* **Sybil flood**: 20 honest peers plus one attacker behind 10 / 30 / 50 % of the identities.
  The attacker trains on every training 1 relabelled 7 (plus its own share) and all its
  identities gossip that model with 5 % jitter. With the weighting, peers also gossip
  sketches of the models they received (16 records of 512 floats per view shuffle). Attack
  success is the share of test 1s that honest peers' models read as 7 (mean over honest
  peers, last 3 rounds), with the SybilWall-style weighting (``sybil = true``) and without.
* **Real peers**: ``murmura run --gossip --clients 10`` on loopback gRPC, exchanging models,
  in seed mode (zeroth-order training; peers exchange (seed, scalar) step logs), and in
  MoDeST-style sampled rounds.

Run: ``python benchmarks/gossip.py [--quick | --smoke]``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Column, Report, parse_args, progress, pyplot  # noqa: E402
from murmura.client.malicious import Attack  # noqa: E402
from murmura.gossip import GossipConfig  # noqa: E402
from murmura.protocols import TaskSettings  # noqa: E402
from murmura.server import ServerConfig  # noqa: E402
from murmura.simulation.api import simulate  # noqa: E402
from murmura.simulation.config import SimulationConfig  # noqa: E402
from murmura.simulation.data import load_simulation_data  # noqa: E402
from murmura.simulation.gossip import (  # noqa: E402
    GossipFailures,
    GossipResult,
    GossipSimulation,
    SybilFlood,
)
from murmura.tasks import ArrayDataset, TaskConfig  # noqa: E402

NAME = "gossip"
LR, EPOCHS, BATCH, MOMENTUM = 0.1, 3, 16, 0.5
EL_EPOCHS = 1  # Epidemic rows: one epoch per round (see the note on local work)
SOURCE, TARGET = 1, 7
SEED_STEPS, SEED_LR = 30, 0.01
SIM_SEED_LR = 0.05  # the simulated seed-mode rows (batch 32)
LAST = 3
#: Sybil flood: seeds (training, topology, clone jitter) each share is run with; one seed's
#: attack success moves by a few test images, too little to compare shares on
SYBIL_SEEDS = (0, 1, 2)
#: Epidemic at n = 1,000: rounds of the full run. The synthetic task climbs for a long time
#: (FedAvg 0.45 / 0.62 / 0.85 / 0.885 after 10 / 20 / 60 / 100 rounds), and while it climbs
#: a lag of a few rounds reads as a gap of several points; by 100 rounds FedAvg gains under
#: 0.05 points a round, so the gap there is a difference in where the two end up. The note
#: reports the gap at every checkpoint and the lag in rounds, so the climb is not hidden.
FULL_ROUNDS_1000 = 100
#: rounds after which the Epidemic rows report the gap to FedAvg (those within the run)
CHECKPOINTS = (10, 20, 30, 60, 100)
#: --quick runs Epidemic n = 1,000 for the full rounds too (a shorter run would measure the
#: climb, not the target), evaluating the 1,000 peers' models every this many rounds (every
#: round is over half the run's time) and without the example-weighted variant
QUICK_EVAL_EVERY = 10


Curve = list[float | None]  # accuracy after each round; None where it was not evaluated


def gaps_by_round(base: list[float], plain: Curve, weighted: Curve | None) -> str:
    """FedAvg minus gossip accuracy, in points, after each checkpoint round within the run
    and the last one, for equal and (when run) example-weighted mixing."""
    runs = [(plain, "points with equal mixing weights", "equal")]
    if weighted is not None:
        runs.append((weighted, "with weights by examples", "by examples"))
    last = min(len(base), *(len(curve) for curve, _, _ in runs))
    marks = sorted({k for k in CHECKPOINTS if k <= last} | {last})

    def gaps(curve: Curve) -> str:
        return " / ".join("n/a" if curve[k - 1] is None
                          else f"{100 * (base[k - 1] - curve[k - 1]):+.1f}" for k in marks)

    def lags(curve: Curve) -> str:
        return " / ".join(rounds_to_reach(curve, base[k - 1]) for k in marks)

    return (f"after {' / '.join(map(str, marks))} rounds: "
            + ", ".join(f"{gaps(curve)} {label}" for curve, label, _ in runs)
            + f" (FedAvg {' / '.join(f'{base[k - 1]:.3f}' for k in marks)}). Rounds gossip "
            "needs to reach FedAvg's accuracy of those rounds: "
            + ", ".join(f"{lags(curve)} ({short})" for curve, _, short in runs) + ".")


def rounds_to_reach(curve: Curve, level: float) -> str:
    """The first evaluated round at which ``curve`` reaches ``level``, as text ("> len" when
    it never does within the run)."""
    for j, value in enumerate(curve, start=1):
        if value is not None and value >= level:
            return str(j)
    return f"> {len(curve)}"


def settings(epochs: int = EPOCHS) -> TaskSettings:
    return TaskSettings(local_epochs=epochs, batch_size=BATCH, lr=LR, momentum=MOMENTUM)


def gossip_config(rounds: int, epochs: int = EPOCHS, **kw: Any) -> GossipConfig:
    return GossipConfig(rounds=rounds, lr=LR, local_epochs=epochs, batch_size=BATCH,
                        momentum=MOMENTUM, **kw)


def sim_config(n: int, task: TaskConfig) -> SimulationConfig:
    spc = 50 if task.task == "synthetic" else 0
    return SimulationConfig(clients=n, samples_per_client=spc, executor="vmap")


def fedavg(task: TaskConfig, n: int, rounds: int, *, cohort: int = 0,
           epochs: int = EPOCHS) -> list[float]:
    """Accuracy per round of the server's sync FedAvg (same local work, same split)."""
    server = ServerConfig.from_flat(mode="sync", max_versions=rounds, train=settings(epochs),
                                    cohort_size=cohort, min_clients=min(cohort or n, n))
    result = simulate(task, server, sim_config(n, task), out_dir=None)
    return [r["accuracy"] for r in result.rows if r.get("accuracy") is not None]


def run_gossip(task: TaskConfig, n: int, cfg: GossipConfig, **kw: Any) -> GossipResult:
    return GossipSimulation(task, cfg, sim_config(n, task), out_dir=None, **kw).run()


def tail_mean(values: list[float], k: int = LAST) -> float:
    return float(np.mean(values[-k:]))


def accs(result: GossipResult, key: str = "accuracy") -> list[float]:
    return [r[key] for r in result.rows if r.get(key) is not None]


def by_round(result: GossipResult) -> Curve:
    """Accuracy after each round, None for rounds that were not evaluated."""
    return [r.get("accuracy") for r in result.rows]


def sybil_data(task: TaskConfig, n: int, lead: int) -> Any:
    """The simulation's data, with the attacker's share: every training 1 relabelled 7."""
    data = load_simulation_data(task, sim_config(n, task))
    ones = np.flatnonzero(data.train.y == SOURCE)

    def poison(own: ArrayDataset) -> ArrayDataset:
        x = np.concatenate([own.x, data.train.x[ones]])
        y = np.concatenate([own.y, np.full(len(ones), TARGET, dtype=np.int64)])
        return ArrayDataset(x, y)

    return data, {lead: Attack(data=poison)}


def real_peers(clients: int, rounds: int, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "murmura", "run", "--gossip", "--clients", str(clients),
               "--rounds", str(rounds), "--out", tmp, "-q",
               *(extra or ("--lr", str(LR), "--local-epochs", str(EPOCHS)))]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            progress(f"murmura run --gossip failed: {done.stderr[-500:]}")
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    return {"wall_s": wall, "run_wall_s": summary.get("wall_s"),
            "accuracy": summary.get("final_accuracy"),
            "accuracy_min": summary.get("final_accuracy_min"),
            "consensus": summary.get("final_consensus_distance"),
            "bytes": summary.get("bytes_up"), "rounds": summary.get("rounds"),
            "per_peer_round": (summary.get("bytes_up") or 0) / clients
            / max(summary.get("rounds") or 1, 1),
            "ok": done.returncode == 0}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(NAME, __doc__.splitlines()[0], argv)
    torch.set_num_threads(1)
    quick, smoke = args.quick, args.smoke
    rounds = 15 if quick else 30     # Sybil flood
    el_rounds = 30                   # Epidemic at n = 100 (cheap: the full length always)
    big_rounds = FULL_ROUNDS_1000    # Epidemic at n = 1,000 (--quick: see QUICK_EVAL_EVERY)
    # peers: Epidemic (digits, synthetic), MoDeST (peers, sample, aggregators, rounds),
    # honest peers of the Sybil flood and its seeds, simulated seed mode, real peers
    el_sizes, modest_size = (100, 1000), (100, 20, 3, 30)
    honest, sybil_seeds, seed_n, real_n = 20, SYBIL_SEEDS, 30, 10
    if smoke:  # every case, toy sizes: a handful of peers, 2-4 rounds
        rounds = el_rounds = big_rounds = 2
        el_sizes, modest_size = (10, 20), (10, 4, 2, 4)
        honest, sybil_seeds, seed_n, real_n = 6, SYBIL_SEEDS[:1], 6, 3
    digits = TaskConfig(task="digits", partition="dirichlet", alpha=0.5)
    synthetic = TaskConfig(task="synthetic", model="mlp", partition="dirichlet", alpha=0.5)
    report = Report(NAME, quick=quick, params={
        "rounds": rounds, "rounds_1000": big_rounds, "lr": LR, "local_epochs": EPOCHS,
        "batch_size": BATCH, "momentum": MOMENTUM, "attack": f"{SOURCE}->{TARGET}"})
    rows: list[dict[str, Any]] = []
    curves: dict[str, Curve] = {}

    # -- Epidemic vs FedAvg ---------------------------------------------------------------
    for n, task, r in ((el_sizes[0], digits, el_rounds), (el_sizes[1], synthetic, big_rounds)):
        progress(f"epidemic n={n}: FedAvg baseline")
        t0 = time.perf_counter()
        base = fedavg(task, n, r, epochs=EL_EPOCHS)
        base_s = time.perf_counter() - t0
        progress(f"epidemic n={n}: gossip")
        cfg = gossip_config(r, EL_EPOCHS, topology="epidemic")
        sparse = quick and n == el_sizes[1]
        res = run_gossip(task, n, cfg, eval_every=QUICK_EVAL_EVERY if sparse else 1)
        s = cfg.fanout_for(n)
        gap = 100 * (base[-1] - res.final_accuracy)
        copies = res.bytes_per_peer_round / res.summary["push_bytes"]
        rows.append({"case": f"epidemic n={n} ({task.task})", "accuracy": res.final_accuracy,
                     "baseline": base[-1], "gap": gap, "kb": res.bytes_per_peer_round / 1024,
                     "copies": copies, "wall": res.wall_s, "baseline_wall": base_s})
        curves[f"epidemic n={n}"] = by_round(res)
        curves[f"FedAvg n={n}"] = list(base)
        report.target(f"Epidemic n={n}: FedAvg minus mean peer accuracy", gap, "<=", 2,
                      unit="points", detail=f"gossip {res.final_accuracy:.3f}, FedAvg "
                      f"{base[-1]:.3f}, {r} rounds, {task.task}")
        report.target(f"Epidemic n={n}: models sent per peer per round (s = {s})", copies,
                      "<=", s, detail=f"{res.bytes_per_peer_round / 1024:.1f} KiB per peer "
                      f"per round, one push = {res.summary['push_bytes']} B on the wire")
        if sparse:
            report.note(f"Epidemic n = {n} ({task.task}): FedAvg minus mean peer accuracy "
                        + gaps_by_round(base, by_round(res), None))
            continue
        progress(f"epidemic n={n}: gossip, mixing weighted by examples")
        weighted = run_gossip(task, n, dataclasses.replace(cfg, weight_by_examples=True))
        report.note(f"Epidemic n = {n} ({task.task}): FedAvg minus mean peer accuracy "
                    + gaps_by_round(base, by_round(res), by_round(weighted)))
        rows.append({"case": f"epidemic n={n} ({task.task}), --weight-by-examples",
                     "accuracy": weighted.final_accuracy, "baseline": base[-1],
                     "gap": 100 * (base[-1] - weighted.final_accuracy),
                     "kb": weighted.bytes_per_peer_round / 1024, "copies": copies,
                     "wall": weighted.wall_s, "baseline_wall": base_s})

    # -- MoDeST-style sampling ------------------------------------------------------------
    n, sample, aggregators, m_rounds = modest_size  # cheap: the full length always
    progress("modest: FedAvg with the same cohort")
    base = fedavg(digits, n, m_rounds, cohort=sample)
    modest = gossip_config(m_rounds, topology="modest", sample_size=sample,
                           aggregators=aggregators)
    for label, failures in (("no failures", None),
                            ("50% churn every round", GossipFailures(churn_per_round=0.5)),
                            ("80% crash at mid-run",
                             GossipFailures(fail_fraction=0.8, fail_round=m_rounds // 2))):
        progress(f"modest: {label}")
        res = run_gossip(digits, n, modest, failures=failures)
        curve = accs(res)
        curves[f"MoDeST {label}"] = curve
        rows.append({"case": f"MoDeST n={n}, {label}", "accuracy": tail_mean(curve),
                     "baseline": tail_mean(base), "gap": 100 * (tail_mean(base)
                                                                - tail_mean(curve)),
                     "kb": res.bytes_per_peer_round / 1024, "wall": res.wall_s})
        if failures is None:
            clean = tail_mean(curve)
            report.target("MoDeST: FedAvg (same cohort) minus aggregate accuracy",
                          100 * (tail_mean(base) - clean), "<=", 2, unit="points",
                          detail=f"MoDeST {clean:.3f}, FedAvg {tail_mean(base):.3f}, mean of "
                          f"the last {LAST} rounds")
        else:
            report.target(f"MoDeST with {label}: run without failures minus this run",
                          100 * (clean - tail_mean(curve)), "<=", 2, unit="points",
                          detail=f"{tail_mean(curve):.3f} vs {clean:.3f}")
    curves[f"FedAvg cohort {sample}"] = base

    # -- Sybil flood ----------------------------------------------------------------------
    successes: dict[bool, list[float]] = {True: [], False: []}
    sybil_rows = []
    for share in (0.1, 0.3, 0.5):
        k = max(1, math.ceil(share * honest / (1 - share)))
        n = honest + k
        ids = tuple(range(honest, n))
        for weighting in (True, False):
            progress(f"sybil {share:.0%} ({k} clones), weighting={weighting}, seeds "
                     f"{sybil_seeds}")
            data, attacks = sybil_data(digits, n, ids[0])
            per_seed, acc = [], []
            for seed in sybil_seeds:
                cfg = gossip_config(rounds, topology="epidemic", sybil=weighting, seed=seed)
                res = run_gossip(digits, n, cfg, data=data, attacks=attacks,
                                 sybils=SybilFlood(ids), attack_pair=(SOURCE, TARGET))
                per_seed.append(tail_mean(accs(res, "attack_success")))
                acc.append(tail_mean(accs(res)))
            success = float(np.mean(per_seed))
            successes[weighting].append(success)
            sybil_rows.append({"sybils": f"{share:.0%} ({k} of {n})",
                               "weighting": "on" if weighting else "off",
                               "success": 100 * success,
                               "per_seed": " / ".join(f"{100 * v:.1f}" for v in per_seed),
                               "accuracy": float(np.mean(acc))})
    for share, on, off in zip((0.1, 0.3, 0.5), successes[True], successes[False], strict=True):
        report.target(f"Sybil flood {share:.0%}: attack success with the weighting",
                      100 * on, "<=", 5, unit="%", detail=f"without: {100 * off:.1f}%")
    s_on = successes[True]
    rise = max(100 * (s_on[1] - s_on[0]), 100 * (s_on[2] - s_on[1]))
    report.target("Sybil flood: attack success never rises with more Sybils (weighting on)",
                  rise, "<=", 0.5, unit="points",
                  detail=" / ".join(f"{100 * s:.1f}%" for s in s_on))

    # -- seed mode on the simulator ---------------------------------------------------------
    seed_sim_rows = []
    seed_sim_rounds = 2 if smoke else 10 if quick else 20
    for model in ("logreg", "mlp"):
        progress(f"seed mode, {seed_n} simulated peers, {model}")
        task = TaskConfig(task="digits", model=model, partition="dirichlet", alpha=0.5)
        cfg = GossipConfig(rounds=seed_sim_rounds, seed_mode=True, local_steps=SEED_STEPS,
                           lr=SIM_SEED_LR, batch_size=32)
        res = run_gossip(task, seed_n, cfg)
        curve = accs(res)
        curves[f"seed mode {model}"] = curve
        seed_sim_rows.append({"model": model, "params": res.models.shape[1],
                              "accuracy": curve[-1], "start": curve[0],
                              "kb": res.bytes_per_peer_round / 1024,
                              "push_kb": res.summary["push_bytes"] / 1024,
                              "wall": res.wall_s})
    worst = max(r["kb"] for r in seed_sim_rows)
    report.target("Seed mode: KiB sent per peer per round, simulated, either model size",
                  worst, "<=", 4, unit="KiB", detail=" / ".join(
                      f"{r['model']} ({r['params']:,} parameters) {r['kb']:.2f}"
                      for r in seed_sim_rows))

    # -- real peers -----------------------------------------------------------------------
    real_rounds = 2 if smoke else 10 if quick else 20
    progress(f"{real_n} real peers on loopback")
    real = real_peers(real_n, real_rounds)
    real["case"] = "models (dense-f32)"
    progress(f"{real_n} real peers on loopback, seed mode")
    seed_rounds = 2 if smoke else 10 if quick else 30
    # every peer hears from every other each round (k-regular, degree n - 1): the peers' models
    # stay bit-identical, so the consensus distance is exactly 0
    seeded = real_peers(real_n, seed_rounds, ("--seed-mode", "--local-steps", str(SEED_STEPS),
                                              "--lr", str(SEED_LR), "--topology", "k-regular",
                                              "--degree", str(real_n - 1)))
    seeded["case"] = f"seed mode ({SEED_STEPS} ZO steps/round, all-to-all)"
    progress(f"{real_n} real peers on loopback, MoDeST")
    sampled = real_peers(real_n, real_rounds, ("--topology", "modest", "--sample-size",
                                               str(max(2, real_n // 2)), "--aggregators", "2",
                                               "--lr", str(LR), "--local-epochs", str(EPOCHS)))
    sampled["case"] = (f"MoDeST ({max(2, real_n // 2)} trainers, 2 aggregators a round; "
                       "accuracy of the aggregate)")
    report.target(f"Seed mode: bytes sent per peer per round ({real_n} real peers)",
                  seeded["per_peer_round"] / 1024, "<=", 4, unit="KiB",
                  detail=f"step logs of {SEED_STEPS} (seed, scalar) pairs to {real_n - 1} peers, "
                  "plus "
                  f"view shuffles; the size does not depend on the model's; a model push is "
                  f"{19332 / 1024:.1f} KiB for this MLP")

    report.note(
        f"Local work: {EL_EPOCHS} epoch of SGD per round in the Epidemic rows and their "
        f"FedAvg baselines, {EPOCHS} epochs in the MoDeST and Sybil rows (batch {BATCH}, lr "
        f"{LR}, momentum {MOMENTUM}); gossip rounds and FedAvg rounds match one for one. With "
        "3 epochs per round Epidemic lags FedAvg on digits at n = 100 (0.709 against 0.847 "
        "after 15 rounds in an earlier quick run): about 14 examples per peer, Dirichlet 0.5 "
        "and 3 epochs make the peers drift apart faster than mixing with ~7 neighbours a round "
        "brings them back. Simulated "
        "peers are `PeerNode`s, the class deployed peers run: the same target choice, "
        "refusals, mixing and view shuffles; training through the simulator's vectorised "
        "executor.")
    if quick:
        report.note(f"Quick mode: Epidemic at n = 1,000 runs the full {big_rounds} rounds "
                    f"with the peers evaluated every {QUICK_EVAL_EVERY} rounds and without "
                    f"the example-weighted variant; {rounds} rounds instead of 30 for the "
                    "Sybil flood; Epidemic at n = 100 and MoDeST run 30 rounds in both "
                    "modes; the same targets.")
    report.table("Accuracy and traffic", [
        Column("case", "case"), Column("accuracy", "gossip acc", "{:.3f}"),
        Column("baseline", "FedAvg acc", "{:.3f}"), Column("gap", "gap (points)", "{:+.1f}"),
        Column("kb", "KiB / peer / round", "{:.1f}"),
        Column("copies", "model pushes / peer / round", "{:.2f}"),
        Column("wall", "wall s", "{:.1f}")], rows)
    report.table(f"Sybil flood (label flip 1->7), epidemic, {honest} honest peers", [
        Column("sybils", "Sybil identities"), Column("weighting", "Sybil weighting"),
        Column("success", f"attack success % (mean of {len(sybil_seeds)} seeds)", "{:.1f}"),
        Column("per_seed", "per seed %"),
        Column("accuracy", "honest accuracy", "{:.3f}")], sybil_rows)
    report.table(f"{real_n} real peers on loopback (`murmura run --gossip --clients {real_n}`)", [
        Column("case", "exchange"),
        Column("rounds", "rounds"), Column("accuracy", "mean acc", "{:.3f}"),
        Column("accuracy_min", "min acc", "{:.3f}"),
        Column("consensus", "consensus distance", "{:.3f}"),
        Column("bytes", "bytes sent", lambda b: f"{b / 1e6:.2f} MB"),
        Column("per_peer_round", "KiB / peer / round", lambda b: f"{b / 1024:.2f}"),
        Column("run_wall_s", "run wall s", "{:.1f}"),
        Column("wall_s", "with start-up s", "{:.1f}")], [real, seeded, sampled])
    report.table(f"Seed mode on the simulator: {seed_n} peers, epidemic, {SEED_STEPS} "
                 f"zeroth-order steps a round (lr {SIM_SEED_LR}, batch 32)", [
                     Column("model", "model"), Column("params", "parameters", "{:,}"),
                     Column("start", "acc after round 1", "{:.3f}"),
                     Column("accuracy", "final acc", "{:.3f}"),
                     Column("kb", "KiB / peer / round", "{:.2f}"),
                     Column("push_kb", "one model push, KiB", "{:.1f}"),
                     Column("wall", "wall s", "{:.1f}")], seed_sim_rows)
    report.note("Seed mode's accuracy is that of zeroth-order training, far below first-order "
                "after the same rounds (its steps' variance grows with the parameter count: "
                "logistic regression moves faster than the MLP); its traffic is the step logs' "
                "size, which does not depend on the model's.", after_tables=True)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for label, curve in curves.items():
            points = [(k, v) for k, v in enumerate(curve, start=1) if v is not None]
            ax.plot([k for k, _ in points], [v for _, v in points], label=label,
                    linestyle="--" if label.startswith("FedAvg") else "-")
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(report.plot_path(), dpi=100)
        plt.close(fig)
    report.params["curves"] = curves
    report.params["sim"] = dataclasses.asdict(sim_config(100, digits))
    return report.finish(save=not args.no_save)


if __name__ == "__main__":
    raise SystemExit(main())
