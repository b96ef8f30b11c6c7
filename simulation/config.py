"""Typed, self-validating configuration of a simulation (the ``[simulation]`` TOML table).

The task (``[task]``) and the aggregator (``[server]``) are configured exactly as for
``murmura run``; this table says how many virtual clients there are, what devices they run on,
when they are online, and how their training executes on this machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

VECTORISE = ("auto", "on", "off")
EXECUTORS = ("auto", "vmap", "loop", "pool", "ray")
DROPOUT = ("silent", "leave")
#: Mixed precision of the simulated clients' first-order training (``SimulationConfig.amp``).
AMP = ("off", "bf16")
#: Why zeroth-order clients refuse ``amp='bf16'``.
ZO_AMP = ("amp='bf16' applies to first-order training: a zeroth-order client's gradient "
          "estimate is a loss difference at zo_eps, below bfloat16's resolution (use amp='off')")
#: Where the virtual clients' training runs (``cuda:N`` names one GPU of several).
DEVICES = ("cpu", "cuda", "cuda:N", "mps", "auto")
#: ``chunk_size`` on the CPU, and there for ``chunk_size = 0`` (auto).
CPU_CHUNK = 1024
_DEVICE = re.compile(r"cpu|cuda(:\d+)?|mps|auto")


def check_device(name: str, *, here: bool = True) -> None:
    """Raise :class:`ValueError` unless ``name`` is a device this machine has.

    ``name`` is one of :data:`DEVICES`; ``cuda``, ``cuda:N`` and ``mps`` must be present
    (``auto`` and ``cpu`` always are) unless ``here`` is false (a Ray cluster's GPUs, which
    this machine need not have). Imports torch only for an accelerator.
    """
    if not _DEVICE.fullmatch(name):
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name in ("cpu", "auto") or not here:
        return
    import torch

    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            why = "a CPU-only build" if torch.version.cuda is None else "no GPU seen"
            raise ValueError(f"device {name!r} was asked for but CUDA is not available on "
                             f"this machine (torch {torch.__version__}, {why}); use "
                             f"device='cpu' or 'auto'")
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} was asked for but this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s) (cuda:0 .. "
                             f"cuda:{torch.cuda.device_count() - 1})")
    elif not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError("device 'mps' was asked for but MPS is not available on this "
                         "machine; use device='cpu' or 'auto'")


def resolve_device(name: str) -> str:
    """The device a simulation trains on: ``auto`` is ``cuda`` when CUDA is available, else
    ``cpu``; any other name is checked (:func:`check_device`) and returned as it is."""
    check_device(name)
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class SimulationConfig:
    """Virtual clients, their devices and availability, and how training executes.

    Devices: seconds per local step are log-uniform between ``step_time_s`` (the fastest
    device) and ``step_time_s * speed_spread`` (the slowest), unless ``device_trace`` names a
    CSV/JSON file of measured devices. Bandwidths are log-uniform between the best link
    (``uplink_mbps``/``downlink_mbps``) and the best divided by ``bandwidth_spread``.

    Availability: ``always``; ``churn`` (exponential online/offline periods with the given
    means); or the path of a CSV of online intervals (``client,start_s,end_s``). A client that
    goes offline loses its current work; with ``dropout='silent'`` it just vanishes (the
    server finds out at the round deadline), with ``'leave'`` it says goodbye first.

    Execution: ``executor`` ``auto`` lets ``vectorise`` decide: its ``auto`` trains clients
    with ``torch.func.vmap`` when the model allows it (a probe checks), else falls back to a
    process pool of ``workers`` processes, or a plain loop when ``workers`` is 1; ``on``
    insists on vmap, ``off`` never uses it. ``executor`` names a path outright: ``vmap``,
    ``loop``, ``pool`` (``workers`` processes), or ``ray`` (``workers`` Ray actors, on a local
    Ray started for the run, or on the cluster at ``ray_address``; each actor runs the loop,
    or with ``vectorise='on'`` trains its share of a batch as vmapped chunks).
    ``threads`` pins torch's intra-op threads while the simulation runs (default 1: a
    simulated client's tensors are small, and on a small machine OpenMP's synchronisation
    costs more than a second thread gains, 10-20x more when another process holds a core).

    Device: ``device`` says where training runs: ``cpu`` (the default), ``cuda``/``cuda:N``,
    ``mps``, or ``auto`` (CUDA when this machine has it, else the CPU). Only the training moves
    there; the virtual clock, the device model, availability, the aggregator and its policies
    stay on the CPU. ``chunk_size`` is the vectorised path's clients per batch; ``0`` (auto)
    sizes it from the free device memory and one client's footprint (1024 on the CPU). The
    process pool is CPU processes and refuses an accelerator (use the loop or vmap).

    Precision: ``amp`` ``off`` (the default) trains in float32, so every device computes the
    same updates up to rounding; ``bf16`` runs first-order clients' forward and backward
    passes under bfloat16 autocast (the vectorised executor, and the client's own
    ``TorchTrainer`` in the loop and the pool) while parameters, momentum and losses stay
    float32. It pays where matrix products dominate a step (a language model on a GPU), not
    for small models. Zeroth-order clients refuse it: their gradient estimates are loss
    differences at ``zo_eps``, below bfloat16's resolution.
    """

    clients: int = 100
    out: str = "runs/simulate"     # "": write nothing
    # devices
    step_time_s: float = 0.05
    speed_spread: float = 10.0
    stragglers: float = 0.0        # this fraction of the clients is straggler_factor x slower
    straggler_factor: float = 100.0
    device_trace: str = ""
    uplink_mbps: float = 20.0
    downlink_mbps: float = 100.0
    bandwidth_spread: float = 1.0
    latency_ms: float = 20.0
    #: The virtual clients' own --codec: "" (the server's), a codec name, or "auto" (each
    #: client picks after its first push from its link speed, as murmura client --codec auto)
    client_codec: str = ""
    # availability
    availability: str = "always"
    mean_online_s: float = 3600.0
    mean_offline_s: float = 600.0
    dropout: str = "silent"
    # execution on this machine
    executor: str = "auto"         # auto (vectorise decides) | vmap | loop | pool | ray
    ray_address: str = ""          # executor ray: a running cluster ("auto", "HOST:6379", ...)
    vectorise: str = "auto"
    workers: int = 0               # pool processes or Ray actors; 0: one per core (Ray: CPU)
    chunk_size: int = field(default=CPU_CHUNK, metadata={"help": (
        "clients per vmapped batch (0: auto, sized from the free device memory on CUDA; "
        f"{CPU_CHUNK} on the CPU)")})
    device: str = field(default="cpu", metadata={"help": (
        "where the clients train: cpu, cuda, cuda:N, mps, or auto (cuda when available, "
        "else cpu); the virtual clock, availability and the aggregator stay on the CPU")})
    amp: str = field(default="off", metadata={"help": (
        "mixed precision of first-order client training: off (float32, the same arithmetic "
        "on every device) or bf16 (bfloat16 autocast; parameters, momentum and losses stay "
        "float32)")})
    threads: int = 1               # torch threads in this process (0: one per core)
    # data (the task's own data unless one of these is set)
    samples_per_client: int = 0    # synthetic task: generate this many examples per client
    data_path: str = ""            # a local Hugging Face / flwr-datasets dataset directory
    partition_by: str = ""         # natural split of data_path by this column (e.g. writer_id)
    # the run
    max_time_s: float = 0.0        # stop at this virtual time; 0: when max_versions is reached
    checkpoint: bool = False       # write checkpoint.npz at every version, as the server does
    # gossip mode (murmura simulate --gossip; the [gossip] table configures the peers)
    gossip: bool = False
    churn_per_round: float = 0.0   # each peer offline for a round with this probability
    fail_fraction: float = 0.0     # this share of the peers crashes for good...
    fail_round: int = 0            # ...at this round

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        if not self.step_time_s > 0:
            raise ValueError(f"step_time_s must be positive, got {self.step_time_s}")
        if not 0 <= self.stragglers <= 1:
            raise ValueError(f"stragglers is a fraction in [0, 1], got {self.stragglers}")
        if not self.straggler_factor >= 1:
            raise ValueError(f"straggler_factor must be >= 1, got {self.straggler_factor}")
        if not self.speed_spread >= 1:
            raise ValueError(f"speed_spread must be >= 1 (slowest / fastest), got "
                             f"{self.speed_spread}")
        if not self.bandwidth_spread >= 1:
            raise ValueError(f"bandwidth_spread must be >= 1, got {self.bandwidth_spread}")
        if not (self.uplink_mbps > 0 and self.downlink_mbps > 0):
            raise ValueError("uplink_mbps and downlink_mbps must be positive")
        if not self.latency_ms >= 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms}")
        if not self.availability:
            raise ValueError("availability must be 'always', 'churn' or a trace file path")
        if not (self.mean_online_s > 0 and self.mean_offline_s > 0):
            raise ValueError("mean_online_s and mean_offline_s must be positive")
        if self.dropout not in DROPOUT:
            raise ValueError(f"dropout must be one of {DROPOUT}, got {self.dropout!r}")
        if self.vectorise not in VECTORISE:
            raise ValueError(f"vectorise must be one of {VECTORISE}, got {self.vectorise!r}")
        if self.client_codec and self.client_codec != "auto":
            from murmura.protocols import available_codecs

            if self.client_codec not in available_codecs():
                raise ValueError(f"client_codec must be '', 'auto' or one of "
                                 f"{', '.join(available_codecs())}, got {self.client_codec!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.executor == "vmap" and self.vectorise == "off":
            raise ValueError("executor='vmap' contradicts vectorise='off'")
        if self.executor in ("loop", "pool") and self.vectorise == "on":
            raise ValueError(f"executor={self.executor!r} contradicts vectorise='on' (vmap)")
        if self.executor == "pool" and self.workers == 1:
            raise ValueError("executor='pool' needs workers >= 2 (or 0: one per core); "
                             "workers=1 is executor='loop'")
        if self.ray_address and self.executor != "ray":
            raise ValueError(f"ray_address is only used with executor='ray', got "
                             f"executor={self.executor!r}")
        if self.ray_address != self.ray_address.strip() or " " in self.ray_address:
            raise ValueError(f"ray_address must be an address such as 'auto', 'HOST:6379' or "
                             f"'ray://HOST:10001', got {self.ray_address!r}")
        if self.workers < 0 or self.threads < 0:
            raise ValueError("workers and threads must be >= 0")
        if self.chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 1, or 0 (auto), got {self.chunk_size}")
        if self.amp not in AMP:
            raise ValueError(f"amp must be one of {AMP}, got {self.amp!r}")
        if self.amp != "off" and self.executor == "ray":
            raise ValueError(f"amp={self.amp!r} runs on this machine's executors (loop, pool, "
                             f"vmap); the Ray executor trains in float32")
        # a Ray cluster's GPUs need not be on this machine (the driver's)
        check_device(self.device, here=not (self.executor == "ray" and self.ray_address))
        if self.executor == "pool" and self.device not in ("cpu", "auto"):
            raise ValueError(f"executor='pool' runs forked CPU processes and can't share "
                             f"device={self.device!r}; use executor='loop' or 'vmap' (one "
                             f"process drives the accelerator)")
        if self.gossip and self.device not in ("cpu", "auto"):
            raise ValueError(f"gossip simulations train on the CPU; device={self.device!r} "
                             f"is not supported with gossip=True")
        if self.samples_per_client < 0:
            raise ValueError(f"samples_per_client must be >= 0, got {self.samples_per_client}")
        if self.partition_by and not self.data_path:
            raise ValueError("partition_by needs data_path (a dataset with that column)")
        if not (0 <= self.churn_per_round < 1 and 0 <= self.fail_fraction < 1
                and self.fail_round >= 0):
            raise ValueError("churn_per_round and fail_fraction must lie in [0, 1), "
                             "fail_round >= 0")
        if not self.max_time_s >= 0:
            raise ValueError(f"max_time_s must be >= 0, got {self.max_time_s}")


def output_dir(sim: SimulationConfig, out_dir: str | Path | None | bool) -> Path | None:
    """Where a simulation writes its results: ``out_dir`` when given (None or "": nowhere),
    else (``True``) ``sim.out``, where "" means nowhere too, not the working directory."""
    chosen = sim.out if out_dir is True else out_dir
    return Path(chosen) if chosen else None


__all__ = ["AMP", "CPU_CHUNK", "DEVICES", "DROPOUT", "EXECUTORS", "VECTORISE", "SimulationConfig",
           "ZO_AMP", "check_device", "output_dir", "resolve_device"]
