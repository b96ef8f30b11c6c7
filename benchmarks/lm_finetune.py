"""Federated fine-tuning of a small GPT with seed updates, against first-order FedAvg with int8.

What FedKSeed and Ferret are for: full-parameter fine-tuning of a language model where each
client sends a few KB per round. On the bundled ``lm`` task (docs/llm.md):

1. **Pre-training, first order**: the ``gpt1m`` decoder (1.02 M parameters) trained with AdamW
   on four of the corpus's eight sources (weather, recipes, sports, trains).
2. **Federated fine-tuning** on the other four sources (shop, fables, logs, letters), split
   over the clients non-IID by source (Dirichlet 0.5), from the pre-trained model, in two
   runs of the same length (rounds x local steps x batch):
   * **seed**: the zeroth-order trainer, codec ``seed`` (a seed and a float16 scalar per step);
   * **int8**: first-order SGD (momentum 0.5), codec ``int8``.

Both runs are real deployments on loopback: an aggregator over gRPC (identities on, signed
updates, sync rounds) and one ``ClientRuntime`` thread per client. The server evaluates every
version on held-out windows of the fine-tuning sources. Reported: perplexity before and
after, bytes each client sends per round, wall time.

Targets: the seed run lowers the fine-tuning perplexity by at least 1 % (after/before <= 0.99),
and its bytes per client per round are at most 1 % of the int8 run's.

Run: ``python benchmarks/lm_finetune.py [--quick | --smoke]``.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import Column, Report, parse_args, progress, pyplot  # noqa: E402

NAME = "lm_finetune"
PRETRAIN_SOURCES = (0, 1, 2, 3)   # weather, recipes, sports, trains
FINETUNE_SOURCES = (4, 5, 6, 7)   # shop, fables, logs, letters
CLIENTS = 8
BATCH = 16
EVAL_WINDOWS = 256


def _subset(lm: Any, sources: tuple[int, ...]) -> Any:
    """The LMData restricted to windows of ``sources`` (train and test)."""
    from murmura.tasks.lm import LMData

    tr = np.flatnonzero(np.isin(lm.train_source, sources))
    te = np.flatnonzero(np.isin(lm.test_source, sources))
    return LMData(lm.train.subset(tr), lm.test.subset(te), lm.train_source[tr],
                  lm.test_source[te], lm.tokenizer, lm.sources)


def pretrain(model: Any, data: Any, steps: int, seed: int) -> None:
    """AdamW on random batches of ``data``: the first-order pre-training."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    x_all, y_all = torch.from_numpy(data.x), torch.from_numpy(data.y)
    model.train()
    for step in range(steps):
        idx = torch.randint(len(data), (32,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x_all[idx]), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % max(steps // 4, 1) == 0:
            progress(f"pre-training step {step + 1}/{steps}: loss {float(loss.detach()):.3f}")


def federate(kind: str, task: Any, start: np.ndarray, rounds: int, local_steps: int,
             seed: int) -> dict[str, Any]:
    """One federated fine-tuning run over loopback gRPC: perplexity per version and bytes."""
    import torch

    from murmura.client import ClientRuntime, GrpcTransport, RetryPolicy, TorchTrainer
    from murmura.client.zo import ZOTrainer
    from murmura.protocols import ModelSpec, TaskSettings
    from murmura.server import ServerConfig, ServerThread
    from murmura.server.app import assemble_core
    from murmura.tasks.lm import evaluate_lm

    torch.set_num_threads(1)  # many client threads on few cores, as murmura run's clients
    eval_model = task.build_model(seed=0)
    spec = ModelSpec.from_module(eval_model)
    test = task.test.subset(np.arange(min(EVAL_WINDOWS, len(task.test))))
    history: list[dict[str, float]] = []  # one entry per version (the publisher's order)

    def evaluate(params: np.ndarray) -> dict[str, float]:
        spec.load_into(eval_model, params)
        return evaluate_lm(eval_model, test)

    def evaluator(params: np.ndarray) -> dict[str, float]:
        metrics = evaluate(params)
        history.append(metrics)
        return metrics

    if kind == "seed":
        train = TaskSettings(trainer="zo", codec="seed", local_steps=local_steps,
                             batch_size=BATCH, lr=1e-3, zo_eps=1e-3, seed=seed)
    else:
        train = TaskSettings(trainer="sgd", codec="int8", local_steps=local_steps,
                             batch_size=BATCH, lr=0.1, momentum=0.5, seed=seed)
    config = ServerConfig.from_flat(mode="sync", min_clients=CLIENTS, max_versions=rounds,
                                    workers=0, round_deadline_s=600, seed=seed, train=train)
    core = assemble_core(config, spec, start, out_dir=None, evaluator=evaluator,
                         checkpoint=False)
    before = evaluate(start)
    trainers = []
    for i in range(CLIENTS):
        model = task.build_model(seed=0)
        spec.load_into(model, start)
        data = task.client_data(i, CLIENTS)
        trainers.append(ZOTrainer(model, data, device="cpu", return_params=False)
                        if kind == "seed" else TorchTrainer(model, data, device="cpu", amp="off"))
    t0 = time.perf_counter()
    with ServerThread(core, "127.0.0.1:0") as srv:
        clients = [ClientRuntime(GrpcTransport(srv.address, timeout_s=120), trainer,
                                 wait_s=2.0, retry=RetryPolicy(initial_s=0.05,
                                                               give_up_after_s=600))
                   for trainer in trainers]
        threads = [threading.Thread(target=rt.run, daemon=True) for rt in clients]
        for th in threads:
            th.start()
        done = srv.wait_done(timeout=3600)
        for th in threads:  # while the server still answers: clients learn the run is over
            th.join(60)
        bytes_up = srv.call(lambda: core.traffic.bytes_up)
        for rt in clients:
            rt.transport.close()
    wall = time.perf_counter() - t0
    return {"kind": kind, "done": done, "before": before, "history": history,
            "after": history[-1] if history else before, "bytes_up": bytes_up,
            "bytes_per_client_round": bytes_up / max(CLIENTS * len(history), 1),
            "wall_s": wall}


def run(argv: list[str] | None = None) -> int:
    args = parse_args(NAME, __doc__.splitlines()[0], argv)
    from functools import partial

    from murmura.protocols import ModelSpec
    from murmura.tasks import TaskConfig
    from murmura.tasks.lm import LMTask, gpt, load_lm_data

    smoke, quick = args.smoke, args.quick
    rounds = 2 if smoke else 8 if quick else 20
    local_steps = 3 if smoke else 40
    pre_steps = 10 if smoke else 300 if quick else 600
    chars = 4_000 if smoke else 40_000
    seed = 0
    cfg = TaskConfig(task="lm", model="gpt1m", partition="dirichlet", alpha=0.5)
    lm = load_lm_data(seed=cfg.data_seed, chars_per_source=chars)
    factory = partial(gpt, cfg.model, lm.tokenizer.vocab_size)
    pre, ft = _subset(lm, PRETRAIN_SOURCES), _subset(lm, FINETUNE_SOURCES)
    task = LMTask(cfg, ft.train, ft.test, factory, data=ft)
    report = Report(NAME, quick=quick, params={
        "model": "gpt1m", "clients": CLIENTS, "rounds": rounds, "local_steps": local_steps,
        "batch": BATCH, "pretrain_steps": pre_steps, "pretrain_sources":
            [lm.sources[s] for s in PRETRAIN_SOURCES], "finetune_sources":
            [lm.sources[s] for s in FINETUNE_SOURCES], "partition": "dirichlet 0.5 by source",
        "seed_run": "zo trainer, lr 1e-3, eps 1e-3, codec seed (fp16 scalars)",
        "int8_run": "sgd lr 0.1 momentum 0.5, codec int8"})
    model = task.build_model(seed=0)
    progress(f"pre-training gpt1m ({sum(p.numel() for p in model.parameters()):,} parameters) "
             f"on {', '.join(report.params['pretrain_sources'])}: {pre_steps} AdamW steps")
    pretrain(model, pre.train, pre_steps, seed)
    start = ModelSpec.from_module(model).flatten(model)
    results = {}
    for kind in ("seed", "int8"):
        progress(f"federated fine-tuning, {kind}: {CLIENTS} clients, {rounds} rounds x "
                 f"{local_steps} local steps")
        results[kind] = federate(kind, task, start, rounds, local_steps, seed)
        r = results[kind]
        progress(f"{kind}: perplexity {r['before']['perplexity']:.2f} -> "
                 f"{r['after']['perplexity']:.2f}, {r['bytes_per_client_round']:.0f} bytes per "
                 f"client per round, {r['wall_s']:.0f} s")
    rows = [{"run": kind, "before": r["before"]["perplexity"], "after":
             r["after"]["perplexity"], "acc_after": r["after"]["accuracy"],
             "bytes": r["bytes_per_client_round"], "wall_s": r["wall_s"]}
            for kind, r in results.items()]
    columns = [Column("run", "run"), Column("before", "perplexity before", "{:.2f}"),
               Column("after", "perplexity after", "{:.2f}"),
               Column("acc_after", "token accuracy after", "{:.3f}"),
               Column("bytes", "bytes per client per round", "{:,.0f}"),
               Column("wall_s", "wall s", "{:.0f}")]
    report.table("Fine-tuning perplexity on the held-out windows of the fine-tuning sources",
                 columns, rows)
    seed_r, int8_r = results["seed"], results["int8"]
    report.target("seed_perplexity_after_vs_before",
                  seed_r["after"]["perplexity"] / seed_r["before"]["perplexity"], "<=", 0.99,
                  unit="x")
    report.target("seed_bytes_vs_int8", seed_r["bytes_per_client_round"]
                  / int8_r["bytes_per_client_round"], "<=", 0.01, unit="x")
    report.note(f"Same run length for both: {rounds} rounds x {local_steps} local steps x batch "
                f"{BATCH} on each of {CLIENTS} clients. Bytes are the wire bytes of every push "
                "(header and signature included) divided by clients x rounds.")
    _plot(report, results)
    return report.finish(save=not args.no_save)


def _plot(report: Report, results: dict[str, dict[str, Any]]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for kind, r in results.items():
        versions = list(range(len(r["history"]) + 1))
        ppl = [r["before"]["perplexity"]] + [m["perplexity"] for m in r["history"]]
        label = f"{kind} ({r['bytes_per_client_round']:,.0f} B/client/round)"
        axes[0].plot(versions, ppl, marker=".", label=label)
        mb = np.array(versions) * r["bytes_per_client_round"] / 1e6
        axes[1].plot(np.maximum(mb, 1e-4), ppl, marker=".", label=kind)
    axes[0].set_xlabel("round")
    axes[1].set_xlabel("MB sent per client (log)")
    axes[1].set_xscale("log")
    for ax in axes:
        ax.set_ylabel("fine-tuning perplexity")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("gpt1m: federated fine-tuning with seed updates vs first-order int8")
    fig.tight_layout()
    fig.savefig(report.plot_path(), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(run())
