"""Who the virtual clients are and what trains them: devices, availability, the executor.

Built once, before the first event: each client's device speed and link (sampled, or from a
trace), when it is online (always, churn, or a trace), and which executor trains the batches
(vectorised with torch.func where the model allows, else a loop, a process pool or Ray; the
client's own trainer where the settings or the app require it).
"""

from __future__ import annotations

import logging

from murmura.protocols import TaskSettings
from murmura.simulation.config import ZO_AMP, SimulationConfig, resolve_device
from murmura.simulation.data import SimulationData
from murmura.simulation.devices import (
    AlwaysOn,
    Availability,
    Churn,
    DevicePopulation,
    TraceAvailability,
)
from murmura.simulation.execution import (
    Executor,
    LoopExecutor,
    PoolExecutor,
    check_own_trainer_path,
    default_workers,
    has_own_train,
)
from murmura.simulation.ray_executor import RayExecutor
from murmura.simulation.vectorised import VectorisationError, VectorisedExecutor
from murmura.tasks.app import AppTask

log = logging.getLogger(__name__)


def device_population(sim: SimulationConfig, seed: int) -> DevicePopulation:
    """Each client's step time, link and latency: from ``sim.device_trace``, else sampled."""
    if sim.device_trace:
        return DevicePopulation.from_trace(sim.device_trace, sim.clients,
                                           uplink_mbps=sim.uplink_mbps,
                                           downlink_mbps=sim.downlink_mbps,
                                           latency_ms=sim.latency_ms)
    return DevicePopulation.sample(sim.clients, seed=seed, step_time_s=sim.step_time_s,
                                   speed_spread=sim.speed_spread, uplink_mbps=sim.uplink_mbps,
                                   downlink_mbps=sim.downlink_mbps, latency_ms=sim.latency_ms,
                                   bandwidth_spread=sim.bandwidth_spread,
                                   stragglers=sim.stragglers,
                                   straggler_factor=sim.straggler_factor)


def availability(sim: SimulationConfig, seed: int) -> Availability:
    """When each client is online: always, exponential churn, or a trace file."""
    if sim.availability == "always":
        return AlwaysOn()
    if sim.availability == "churn":
        return Churn(sim.clients, mean_online_s=sim.mean_online_s,
                     mean_offline_s=sim.mean_offline_s, seed=seed)
    return TraceAvailability.from_file(sim.availability)


def choose_executor(sim: SimulationConfig, data: SimulationData,
                    settings: TaskSettings) -> tuple[Executor, str]:
    """The executor that trains the batches, and a note on why (for the run's summary).

    The zeroth-order trainer and an app's own ``train``/``loss`` run each client's own
    trainer (its step log or its function is what the client would run); otherwise the
    vectorised path is probed against the plain trainer and used when it agrees, falling back
    to a process pool (several cores) or a loop, unless ``sim.executor`` names one.

    ``sim.device`` (``auto`` resolved here) goes to every executor. On an accelerator the
    fallbacks are the loop on that device, never the pool (CPU processes); an explicit
    ``executor='pool'`` with ``device='auto'`` keeps the pool on the CPU.
    """
    factory, train, shares = data.task.model_factory, data.train, data.shares
    workers = sim.workers or default_workers()
    amp = sim.amp
    if amp != "off" and settings.trainer == "zo":
        raise ValueError(ZO_AMP)
    if amp != "off" and isinstance(data.task, AppTask) and data.task.app.fn("train"):
        raise ValueError(f"amp={amp!r} applies to Murmura's trainer; an app's own train() "
                         f"sets its own precision (use amp='off')")
    if sim.executor == "pool":
        device = "cpu"
    elif sim.executor == "ray" and sim.ray_address and sim.device != "auto":
        device = sim.device  # the cluster's GPUs: Ray places the actors on them
    else:
        device = resolve_device(sim.device)
    on_cpu = device == "cpu"
    own_train = has_own_train(data.task)
    zo = settings.trainer == "zo" and not own_train
    if zo and (sim.executor == "vmap" or sim.vectorise == "on"
               or (sim.executor == "auto" and sim.vectorise == "auto" and not on_cpu)):
        # The vectorised twin of the zeroth-order trainer: asked for, or on an accelerator,
        # where one client at a time leaves the device idle between kernel launches. On the
        # CPU, auto keeps each client's own trainer (its step log is the deployed client's
        # bit for bit; vmap's matches it to float32 rounding).
        ex, why = _vectorised(data, sim, device, settings, "zeroth-order training")
        if ex is not None:
            return ex, f"the zeroth-order trainer vectorised: {why}"
        log.warning("vectorised zeroth-order training is not possible for this model (%s); "
                    "each client runs its own trainer on %s", why, device)
    if settings.trainer == "zo" or own_train:
        what = "an app's own train() or loss()" if own_train else "the zeroth-order trainer"
        check_own_trainer_path(what, sim.executor, sim.vectorise, vectorised=zo)
        note = f"{what}: each client's own trainer"
        if sim.executor == "pool" or (sim.executor != "loop" and workers > 1 and on_cpu):
            return PoolExecutor(factory, train, shares, workers=workers, task=data.task,
                                amp=amp), note
        return LoopExecutor(factory, train, shares, task=data.task, device=device,
                            amp=amp), note
    if sim.executor in ("loop", "pool", "ray"):
        note = f"executor={sim.executor!r}"
        if sim.executor == "ray":
            vectorise = sim.vectorise == "on"
            if vectorise:  # checked here, on the CPU, before any actor starts
                try:
                    probe = VectorisedExecutor(factory, train, shares).probe(settings)
                except VectorisationError as exc:
                    raise ValueError(f"executor='ray' with vectorise='on' but the model "
                                     f"can't be vectorised: {exc}") from exc
                note = f"executor='ray', vectorise='on': vmapped chunks on the actors ({probe})"
            return RayExecutor(factory, train, shares, address=sim.ray_address or None,
                               workers=sim.workers, device=device, vectorise=vectorise,
                               chunk_size=sim.chunk_size), note
        if sim.executor == "pool":
            return PoolExecutor(factory, train, shares, workers=workers, amp=amp), note
        return LoopExecutor(factory, train, shares, device=device, amp=amp), note
    if sim.vectorise != "off":
        ex, why = _vectorised(data, sim, device, settings, "the model")
        if ex is not None:
            return ex, why
        pool = workers > 1 and on_cpu
        log.warning("vectorised training is not possible for this model (%s); falling "
                    "back to %s", why, "a process pool" if pool else f"a plain loop on {device}")
        note = f"vmap unavailable: {why}"
    else:
        note = "vectorise='off'"
    if workers > 1 and on_cpu:
        return PoolExecutor(factory, train, shares, workers=workers, amp=amp), note
    return LoopExecutor(factory, train, shares, device=device, amp=amp), note


def _vectorised(data: SimulationData, sim: SimulationConfig, device: str,
                settings: TaskSettings, what: str) -> tuple[VectorisedExecutor | None, str]:
    """The vectorised executor and its probe's note, or (None, why) when the model can't be
    vectorised; a ValueError instead when ``sim`` insists on vmap."""
    try:
        ex = VectorisedExecutor(data.task.model_factory, data.train, data.shares,
                                chunk_size=sim.chunk_size, device=device, amp=sim.amp)
        return ex, ex.probe(settings)
    except VectorisationError as exc:
        if sim.vectorise == "on" or sim.executor == "vmap":
            asked = "vectorise='on'" if sim.vectorise == "on" else "executor='vmap'"
            raise ValueError(f"{asked} but {what} can't be vectorised: {exc}") from exc
        return None, str(exc)


__all__ = ["availability", "choose_executor", "device_population"]
