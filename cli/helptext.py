"""Help lines for the flags that mirror config fields (``--help`` and docs read them).

A config field's help is, in order: its own ``metadata["help"]``, else the line here under its
class and name. ``{codecs}``, ``{rules}`` and the other placeholders are filled from the live
registries when the parser is built, so ``--help`` lists exactly what the code accepts.
``cli.config.add_arguments`` appends the field's default. A test walks every parser and fails
on a flag without help, so a new field needs a line here (or its own metadata).
"""

from __future__ import annotations

__all__ = ["FIELD_HELP", "choices", "field_help"]


def _join(values: object) -> str:
    return ", ".join(str(v) for v in values if v != "")  # type: ignore[attr-defined]


def choices() -> dict[str, str]:
    """Valid values of the registry-backed options, as comma-separated lists (read at each
    parser build: an app file may have registered more rules since the last one). Read
    through :mod:`murmura.catalog` and config modules only: ``--help`` loads no torch."""
    from murmura.catalog import AMP_MODES, ATTACKS, DEVICES
    from murmura.catalog import codecs as available_codecs
    from murmura.catalog import optimizers as available_optimizers
    from murmura.catalog import rules as available_aggregators
    from murmura.gossip.config import TOPOLOGIES
    from murmura.server.config import (
        ACCUMULATORS,
        BACKENDS,
        COMPASS_STEPS,
        MODES,
        ROLES,
        STALENESS,
        WORKER_FOLDS,
    )
    from murmura.simulation.config import DROPOUT, EXECUTORS, VECTORISE
    from murmura.tasks.config import PARTITIONERS, TASK_MODELS

    by_models: dict[tuple[str, ...], list[str]] = {}  # tasks that share one list of models
    for task, models in TASK_MODELS.items():
        by_models.setdefault(models, []).append(task)
    return {
        "codecs": _join(available_codecs()), "rules": _join(available_aggregators()),
        "optimizers": _join(available_optimizers()), "attacks": _join(ATTACKS),
        "amp": _join(AMP_MODES), "devices": _join(DEVICES), "topologies": _join(TOPOLOGIES),
        "accumulators": _join(ACCUMULATORS), "backends": _join(BACKENDS),
        "modes": _join(MODES), "compass_steps": _join(COMPASS_STEPS), "roles": _join(ROLES),
        "staleness": _join(STALENESS), "worker_folds": _join(WORKER_FOLDS),
        "dropout": _join(DROPOUT), "executors": _join(EXECUTORS),
        "vectorise": _join(VECTORISE), "partitions": _join(PARTITIONERS),
        "models": "; ".join(f"{_join(models)} ({_join(tasks)})"
                            for models, tasks in by_models.items()),
        "default_models": ", ".join(f"{models[0]} for {' and '.join(tasks)}"
                                    for models, tasks in by_models.items()),
        "tasks": _join(sorted(TASK_MODELS)),
    }


#: class name -> field name -> help template (placeholders: the keys of :func:`choices`).
FIELD_HELP: dict[str, dict[str, str]] = {
    "RunConfig": {
        "clients": "number of client processes (or threads with --in-process) to start",
        "out": "directory for metrics.jsonl, summary.json, accuracy.png and client logs",
        "client_threads": "torch intra-op threads per client",
        "timeout_s": "stop the run after this many seconds of wall time",
        "in_process": "run the clients as threads of this process instead of N forked "
                      "processes (one GIL: slower training)",
        "gossip": "run N gossip peers and no server (the [gossip] table; docs/gossip.md)",
    },
    "TaskConfig": {
        "task": "bundled task (data set): {tasks}",
        "model": "bundled model for the task: {models} (default: the task's first: "
                 "{default_models})",
        "partition": "how the training data is split over clients: {partitions}",
        "alpha": "concentration of the dirichlet and quantity partitions (smaller: more "
                 "skewed shares); > 0",
        "data_seed": "seed of the data split (the same on every machine)",
    },
    "ServerConfig": {  # [server]; the keys of its sub-configs (below) are written flat there
        "address": "HOST:PORT to serve on (port 0: any free port, printed at start)",
        "mode": "{modes}: sync rounds over a cohort, async FedBuff steps every --buffer-size "
                "updates, or compass (FedCompass: local steps per client from its speed)",
        "max_versions": "stop after this many global model versions (>= 1)",
        "seed": "seed of the run: cohorts, client keys (murmura run) and training",
    },
    "PolicyConfig": {
        "cohort_size": "sync: clients per round (0: --cohort-fraction of the joined clients)",
        "cohort_fraction": "sync: share of the joined clients in each round's cohort, in (0, 1]",
        "min_clients": "clients that must have joined before the first round (>= 1)",
        "round_deadline_s": "sync: close a round after this many seconds with the updates in",
        "liveness_factor": "sync: a cohort member silent for this many times its measured "
                           "task time (fetch to push) loses its session and the round goes "
                           "on without it; >= 1, or 0 for the round deadline alone",
        "buffer_size": "async: updates folded into each new version (>= 1)",
        "max_staleness": "refuse updates more than this many versions old (>= 0)",
        "staleness": "async: weight of a stale update: {staleness}",
        "staleness_exponent": "async: exponent of the polynomial staleness weight",
        "compass_max_steps": "compass: most local steps a client gets (0: --local-steps)",
        "compass_min_steps": "compass: fewest local steps (0: a fifth of the maximum)",
        "compass_latest_factor": "compass: aggregate a group after this times its planned "
                                 "duration",
        "compass_step": "compass: how far a version of m updates moves the model, in "
                        "weighted means of them: {compass_steps} (sqrt: sqrt(m/N), at least "
                        "1; linear: m/N)",
        "compass_step_updates": "compass: N of --compass-step (0: --buffer-size)",
        "compass_max_group": "compass: most members per arrival group (0: no limit)",
        "defense": "aggregation rule: {rules} (fedavg: plain weighted mean)",
        "defense_options": "the rule's options, e.g. f=2 (krum) or trim=0.2 (trimmed-mean)",
        "optimizer": "server optimizer applied to each aggregate: {optimizers}",
        "server_lr": "server learning rate (> 0)",
        "accumulator": "{accumulators}: float32 (fast) or exact (order-independent, "
                       "bit-identical; fedavg only)",
    },
    "TierConfig": {
        "workers": "decoding workers: -1 autoscaled worker processes, 0 in this process, N at "
                   "most N processes",
        "max_workers": "most worker processes when autoscaled (0: cores - 1)",
        "worker_idle_s": "an idle decoding worker stops after this many seconds",
        "max_queue": "updates waiting for a worker before pushes are refused (>= 1)",
        "slab_mb": "shared memory (MB) for payloads and decoded updates in flight",
        "backend": "where decoding workers run: {backends}",
        "ray_address": "backend ray: a cluster address (empty: start a local Ray)",
        "worker_folds": "{worker_folds}: fold accepted updates into partial aggregates in the "
                        "process workers (auto: for fedavg/FedBuff on models of 65,536 "
                        "values or more; off: one fold at a time on the publisher)",
        "receivers": "processes that receive pushes (gRPC Push) on their own port, so the "
                     "gateway process only checks and hands on each update (0: the gateway "
                     "receives them; needs worker processes)",
        "push_port": "the receivers' port on this host, announced to clients at Join (0: any "
                     "free port)",
    },
    "SecurityConfig": {
        "join_token": "clients must present this token at Join (empty: none needed)",
        "max_payload_mb": "refuse updates larger than this many MB",
        "session_ttl_s": "a session unused this long expires (0: never)",
        "dedup_ttl_s": "counted update ids, payload hashes and ended sessions are remembered "
                       "this long (and at most 100,000 of each): a push retried later counts "
                       "again, so keep it above the clients' --give-up-after-s (0: no age "
                       "bound)",
        "max_sessions": "joins beyond this many live sessions are refused",
        "join_per_s": "joins per second per client id, bursts of 10 (0: no limit)",
        "push_per_s": "pushes per second per client id, bursts of 50 (0: no limit)",
    },
    "LeafConfig": {
        "role": "{roles}: top aggregator, or leaf (folds its clients' updates and pushes "
                "them to --upstream)",
        "upstream": "leaf: the parent aggregator's HOST:PORT",
        "name": "leaf: its name in logs",
    },
    "TaskSettings": {  # [server.train]: what the server tells clients to do
        "trainer": "local training: sgd, or zo (zeroth-order, forward passes only)",
        "local_epochs": "local epochs per task (used when --local-steps is 0)",
        "local_steps": "local steps per task (0: --local-epochs)",
        "batch_size": "local batch size (> 0)",
        "lr": "client learning rate (> 0)",
        "momentum": "client SGD momentum, in [0, 1)",
        "codec": "how clients encode updates: {codecs} (docs/codecs.md)",
        "codec_options": "the codec's options, e.g. ratio=0.01 (topk) or bits=4 (quant)",
        "zo_eps": "zo: perturbation size of the finite differences (> 0)",
    },
    "ClientConfig": {
        "server": "the aggregator's HOST:PORT",
        "device": "{devices} or cuda:N",
        "codec": "encode updates with this codec instead of the server's: {codecs}, or auto "
                 "(picked from the measured link speed); empty: the server's choice",
        "token": "join token the server asks for (--join-token)",
        "client_index": "which share of the task's data this client trains on (0-based)",
        "num_clients": "how many shares the data is split into",
        "max_tasks": "leave after this many tasks (0: until the server says stop)",
        "wait_s": "how long one GetTask call waits for work on the server",
        "threads": "torch intra-op threads (0: torch's default)",
        "amp": "mixed precision: {amp}",
        "profile": "time a short warm-up at start and send the speed with Join",
        "memory_fraction": "CUDA: cap this process at this share of the GPU, in [0, 1] "
                           "(0: no cap)",
        "micro_batch": "rows per forward pass, accumulating gradients (0: probe on CUDA)",
        "cuda_graph": "CUDA: replay a first-order training step, or a zeroth-order step's "
                      "forward passes, as a captured CUDA graph (fewer launches: pays for "
                      "small models and batches, and makes bf16 pay there; see docs/edge.md)",
        "status_file": "write progress JSON here after every task (murmura launch)",
        "give_up_after_s": "exit when an aggregator that has answered before cannot be "
                           "reached for this many seconds (from the first failed try)",
        "give_up_unreached_s": "exit when the aggregator has not answered once within this "
                               "many seconds of the first try (a wrong address or port, a "
                               "server not started), naming the address and what failed; "
                               "once it has answered, --give-up-after-s applies",
        "attack": "red-team mode for tests: {attacks} (empty: honest)",
        "attack_options": "the attack's options: label-flip source, target; backdoor "
                          "target, fraction, patch, boost; sign-flip scale; scale factor; "
                          "noise std, relative (e.g. --attack scale --attack-option "
                          "factor=10)",
        "ack_log": "append one JSON line per acknowledged update to this file",
    },
    "PeerConfig": {
        "listen": "HOST:PORT this peer serves on (port 0: any free port)",
        "bootstrap": "HOST:PORT[,HOST:PORT...] of peers to join through (empty: the first "
                     "peer)",
        "peer_id": "this peer's id (empty: peer-<client-index>)",
        "client_index": "which share of the task's data this peer trains on (0-based)",
        "num_clients": "how many shares the data is split into",
        "device": "{devices} or cuda:N",
        "threads": "torch intra-op threads (0: torch's default)",
        "catch_up": "a late joiner: pull the most advanced peer's model first",
        "attack": "red-team mode: {attacks} (empty: honest)",
        "attack_options": "the attack's options: label-flip source, target; backdoor "
                          "target, fraction, patch, boost; sign-flip scale; scale factor; "
                          "noise std, relative (e.g. --attack scale --attack-option "
                          "factor=10)",
        "report": "directory for per-round rows (murmura run --gossip)",
        "key": "identity key FILE from `murmura keys new`: the peer signs its messages and "
               "keeps its id across restarts (default: a new ephemeral key per run)",
        "unsigned": "send unsigned messages, for peers that predate signatures (the id is "
                    "then bound to the first address it is seen at)",
    },
    "GossipConfig": {
        "rounds": "gossip rounds each peer runs (>= 1)",
        "topology": "who talks to whom: {topologies}",
        "fanout": "epidemic: peers to send to per round (0: ceil(log2 n))",
        "degree": "k-regular: neighbours per peer",
        "view_size": "size of the peer-sampling view (>= 2)",
        "shuffle_size": "view entries exchanged per shuffle (1..view size)",
        "rule": "how a peer mixes the models it receives: {rules}",
        "rule_options": "the rule's options, as for --defense-option",
        "weight_by_examples": "weight mixed models by the examples they were trained on, "
                              "as FedAvg does (default: equally)",
        "sybil": "weight neighbours by how dissimilar their histories are",
        "history_share": "sybil: history records offered per view shuffle",
        "history_records": "sybil: history records kept per peer",
        "trust_warmup": "sybil: mixings over which neighbours' trust ramps up (0: none)",
        "round_timeout_s": "how long a peer waits for its neighbours' models each round",
        "min_messages": "models to wait for each round (0: the expected in-degree)",
        "max_round_lag": "drop models more than this many rounds behind",
        "require_signatures": "refuse messages from peers that do not sign them "
                              "(UNAUTHENTICATED); every peer of a run must agree on it",
        "max_inbox": "models a peer holds between two mixes (0: twice the largest of view, "
                     "degree, fanout, sample size; at least 64)",
        "min_peers": "peers (self included) to know of before the first round",
        "start_timeout_s": "... or wait this long before the first round",
        "lr": "local learning rate (> 0)",
        "local_epochs": "local epochs per round",
        "local_steps": "local steps per round (0: --local-epochs)",
        "batch_size": "local batch size",
        "momentum": "local SGD momentum, in [0, 1)",
        "seed": "seed of the topology's hashes and of training",
        "seed_mode": "zeroth-order training; peers send (seed, scalar) step logs, not models",
        "zo_eps": "seed mode: perturbation size (> 0)",
        "journal_rounds": "seed mode: rounds of step logs a peer keeps so that a late "
                          "joiner (--catch-up) can replay them (>= 1)",
        "sample_size": "modest: trainers sampled per round",
        "aggregators": "modest: aggregators sampled per round",
    },
    "SimulationConfig": {
        "clients": "number of virtual clients",
        "out": "directory for metrics.jsonl, summary.json and plots ('': write nothing)",
        "step_time_s": "seconds per local step on the fastest virtual device (> 0)",
        "speed_spread": "slowest device / fastest device (>= 1; log-uniform in between)",
        "stragglers": "fraction of clients, in [0, 1], that are --straggler-factor x slower",
        "straggler_factor": "how much slower a straggler is (>= 1)",
        "device_trace": "CSV/JSON file of measured devices (replaces the speed spread)",
        "uplink_mbps": "best client uplink, Mbit/s (> 0)",
        "downlink_mbps": "best client downlink, Mbit/s (> 0)",
        "bandwidth_spread": "best link / worst link (>= 1)",
        "latency_ms": "one-way network latency in milliseconds",
        "client_codec": "the virtual clients' own codec: '' (the server's), a codec name, or "
                        "auto (each client picks from its link speed after its first push, "
                        "as murmura client --codec auto)",
        "availability": "always, churn (exponential online/offline periods), or a CSV of "
                        "online intervals (client,start_s,end_s)",
        "mean_online_s": "churn: mean online period in seconds",
        "mean_offline_s": "churn: mean offline period in seconds",
        "dropout": "how a client going offline behaves: {dropout}",
        "executor": "how clients train on this machine: {executors} (auto: --vectorise "
                    "decides)",
        "ray_address": "executor ray: a running cluster (auto, HOST:6379, ...)",
        "vectorise": "train clients with torch.func.vmap: {vectorise}",
        "workers": "pool processes or Ray actors (0: one per core)",
        "chunk_size": "clients per vmapped batch",
        "amp": "mixed precision of first-order client training: off (float32) or bf16 "
               "(bfloat16 autocast; parameters and losses stay float32)",
        "threads": "torch threads in this process (0: one per core)",
        "samples_per_client": "synthetic task: generate this many examples per client (0: "
                              "the task's own data)",
        "data_path": "a local Hugging Face / flwr-datasets dataset directory",
        "partition_by": "natural split of --data-path by this column (e.g. writer_id)",
        "max_time_s": "stop at this virtual time (0: when --max-versions is reached)",
        "checkpoint": "write checkpoint.npz at every version, as the server does",
        "gossip": "simulate gossip peers instead of a server (the [gossip] table)",
        "churn_per_round": "gossip: each peer is offline for a round with this probability",
        "fail_fraction": "gossip: this share of the peers crashes for good...",
        "fail_round": "gossip: ...at this round",
    },
}


def field_help(owner: str, name: str) -> str | None:
    """The help line of field ``name`` of the config class called ``owner``, if any."""
    text = FIELD_HELP.get(owner, {}).get(name)
    return text.format(**choices()) if text is not None else None
