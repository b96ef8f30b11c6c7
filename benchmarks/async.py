"""Sync FedAvg against FedBuff on heterogeneous devices, in Murmura's virtual time.

50 clients hold Dirichlet(0.5) shares of scikit-learn's digits and train a small MLP (3 local
epochs, batch 16, SGD lr 0.1, momentum 0.5). Devices are log-uniform over a 10x speed range
(0.05 s to 0.5 s per local step) with 20/100 Mbit/s links and 20 ms latency. Both policies run
on the same aggregator core, for the same virtual time: the time sync FedAvg (every client,
every round) needs for its rounds. FedBuff (``mode='async'``) applies a version every 10
updates, weighted by polynomial staleness (``(1 + tau) ** -0.5``).

Measured: the virtual time at which each first reaches the target test accuracy, and the final
accuracy (mean of the last five evaluations, so one noisy version does not decide). Run
``python benchmarks/async.py [--quick | --smoke]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Column, Report, parse_args, progress, pyplot  # noqa: E402

CLIENTS, BUFFER, SPREAD = 50, 10, 10.0


def _time_to(rows: list[dict[str, Any]], target: float) -> float | None:
    for r in rows:
        if r.get("accuracy") is not None and r["accuracy"] >= target:
            return float(r["time_s"])
    return None


def _final(rows: list[dict[str, Any]]) -> float:
    return statistics.fmean(r["accuracy"] for r in rows[-5:])


def one_seed(seed: int, rounds: int, clients: int = CLIENTS) -> dict[str, Any]:
    from murmura.protocols import TaskSettings
    from murmura.server import ServerConfig
    from murmura.simulation import SimulationConfig, simulate
    from murmura.tasks import TaskConfig

    task = TaskConfig(task="digits", model="mlp", partition="dirichlet", alpha=0.5,
                      data_seed=seed)
    train = TaskSettings(local_epochs=3, batch_size=16, lr=0.1, momentum=0.5)
    sim = SimulationConfig(clients=clients, step_time_s=0.05, speed_spread=SPREAD)
    t0 = time.perf_counter()
    sync = simulate(task, ServerConfig.from_flat(mode="sync", max_versions=rounds, seed=seed,
                                                 round_deadline_s=1e6, train=train),
                    sim, out_dir=None)
    budget = sync.virtual_s
    fedbuff = simulate(task, ServerConfig.from_flat(mode="async", max_versions=10**6, seed=seed,
                                                    buffer_size=BUFFER, max_staleness=100,
                                                    train=train),
                       SimulationConfig(clients=clients, step_time_s=0.05,
                                        speed_spread=SPREAD, max_time_s=budget),
                       out_dir=None)
    return {"seed": seed, "budget_s": budget, "sync": sync, "fedbuff": fedbuff,
            "wall_s": time.perf_counter() - t0}


def run(argv: list[str] | None = None) -> int:
    args = parse_args("async", "Sync FedAvg vs FedBuff with a 10x device-speed spread", argv)
    quick = args.quick
    rounds = 3 if args.smoke else 60 if quick else 150
    seeds = [0] if quick or args.smoke else [0, 1, 2]
    clients = 10 if args.smoke else CLIENTS
    target = 0.92
    report = Report("async", quick=quick, params={
        "clients": clients, "task": "digits, MLP(64-64-10), Dirichlet(0.5)",
        "local": "3 epochs, batch 16, lr 0.1, momentum 0.5", "speed_spread": SPREAD,
        "step_time_s": "0.05 to 0.5 (log-uniform)", "buffer_size": BUFFER,
        "staleness": "polynomial, a=0.5", "sync_rounds": rounds, "seeds": seeds,
        "target_accuracy": target})
    rows, runs = [], []
    for seed in seeds:
        progress(f"seed {seed}: sync FedAvg ({rounds} rounds), then FedBuff for the same "
                 f"virtual time")
        r = one_seed(seed, rounds, clients)
        runs.append(r)
        s, f = r["sync"], r["fedbuff"]
        ts, tf = _time_to(s.rows, target), _time_to(f.rows, target)
        row = {"seed": seed, "budget_s": r["budget_s"],
               "sync_versions": s.version, "fedbuff_versions": f.version,
               "sync_time": ts, "fedbuff_time": tf,
               "speedup": ts / tf if ts and tf else None,
               "sync_final": _final(s.rows), "fedbuff_final": _final(f.rows),
               "fedbuff_stale_mean": (sum(k * v for k, v in f.staleness.items())
                                      / max(sum(f.staleness.values()), 1)),
               "wall_s": r["wall_s"]}
        row["final_gap_pts"] = 100 * (row["fedbuff_final"] - row["sync_final"])
        rows.append(row)
        progress(f"  to {target:.0%}: sync {ts} s, FedBuff {tf} s; final sync "
                 f"{row['sync_final']:.4f}, FedBuff {row['fedbuff_final']:.4f} "
                 f"({r['wall_s']:.0f} s wall)")

    def fmt_s(v: Any) -> str:
        return "not reached" if v is None else f"{v:,.1f}"

    cols = [Column("seed", "seed"), Column("budget_s", "virtual budget (s)", "{:,.0f}"),
            Column("sync_time", f"sync to {target:.0%} (s)", fmt_s),
            Column("fedbuff_time", f"FedBuff to {target:.0%} (s)", fmt_s),
            Column("speedup", "FedBuff sooner by", "{:.1f}x"),
            Column("sync_final", "sync final acc", "{:.4f}"),
            Column("fedbuff_final", "FedBuff final acc", "{:.4f}"),
            Column("final_gap_pts", "FedBuff - sync (points)", "{:+.2f}"),
            Column("sync_versions", "sync versions"),
            Column("fedbuff_versions", "FedBuff versions"),
            Column("fedbuff_stale_mean", "FedBuff mean staleness", "{:.1f}"),
            Column("wall_s", "wall (s)", "{:.0f}")]
    report.table("Virtual time to target accuracy and final accuracy", cols, rows)
    speedups = [r["speedup"] for r in rows]
    worst = min(s if s is not None else 0.0 for s in speedups)
    report.target(f"FedBuff reaches {target:.0%} sooner than sync FedAvg (worst seed)", worst,
                  ">=", 2.5, unit="x")
    report.target("FedBuff final accuracy minus sync's (worst seed)",
                  min(r["final_gap_pts"] for r in rows), ">=", -0.5, unit="points")
    report.note(
        f"{clients} clients on digits (Dirichlet 0.5 shares), MLP, devices log-uniform over a "
        f"{SPREAD:g}x speed range (0.05-0.5 s per local step), 20/100 Mbit/s, 20 ms. Sync "
        f"FedAvg: every client every round, so a round lasts as long as its slowest device. "
        f"FedBuff: a version every {BUFFER} updates, staleness weight (1+tau)^-0.5. Both run "
        "on Murmura's aggregator core in virtual time for the same budget (sync's rounds); "
        "final accuracy is the mean of the last five evaluations on the 360 test digits.")
    _plot(report, runs[0], target)
    return report.finish(save=not args.no_save)


def _plot(report: Report, run: dict[str, Any], target: float) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("sync", "sync FedAvg"), ("fedbuff", f"FedBuff (K={BUFFER})")):
        rows = run[key].rows
        axes[0].plot([r["time_s"] for r in rows], [r["accuracy"] for r in rows], label=label,
                     lw=1.2)
    axes[0].axhline(target, color="grey", ls="--", lw=0.8, label=f"target {target:.0%}")
    axes[0].set_xlabel("virtual time (s)")
    axes[0].set_ylabel("test accuracy")
    axes[0].set_ylim(0.5, 1.0)
    axes[0].grid(alpha=0.3)
    axes[0].legend()
    hist = run["fedbuff"].staleness
    keys = sorted(hist)
    axes[1].bar(keys, [hist[k] for k in keys])
    axes[1].set_xlabel("staleness of accepted FedBuff updates (versions)")
    axes[1].set_ylabel("updates")
    axes[1].grid(alpha=0.3, axis="y")
    fig.suptitle(f"Sync FedAvg vs FedBuff, {SPREAD:g}x device-speed spread (seed {run['seed']})")
    fig.tight_layout()
    fig.savefig(report.plot_path(), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    sys.exit(run())
