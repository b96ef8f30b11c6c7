"""Simulation: thousands of virtual clients on one machine, in virtual time, through the real
aggregator core, codecs and trainers (vectorised with torch.func where the model allows)."""

from typing import TYPE_CHECKING

from murmura.protocols.lazy import lazy_getattr

if TYPE_CHECKING:
    from murmura.simulation.api import prepare_server, simulate
    from murmura.simulation.attacks import BatchHook, UpdateBatch
    from murmura.simulation.clock import EventQueue, VirtualClock
    from murmura.simulation.config import SimulationConfig
    from murmura.simulation.data import (
        SimulationData,
        load_local_dataset,
        load_simulation_data,
        natural,
    )
    from murmura.simulation.devices import (
        AlwaysOn,
        Availability,
        Churn,
        DevicePopulation,
        TraceAvailability,
    )
    from murmura.simulation.engine import Simulation, SimulationResult, client_id
    from murmura.simulation.execution import (
        Executor,
        Job,
        JobResult,
        LoopExecutor,
        PoolExecutor,
    )
    from murmura.simulation.ray_executor import RayExecutor
    from murmura.simulation.transport import InMemoryTransport, LocalAggregator
    from murmura.simulation.vectorised import (
        VectorisationError,
        VectorisedExecutor,
        local_schedule,
    )
    from murmura.simulation.wire import ModelWire, update_header_bytes, update_wire_bytes

#: Where each name lives, imported on first use: a submodule (a config the command-line
#: parser reads) can then be imported without torch and the rest of the package.
_LAZY = {
    "prepare_server": "murmura.simulation.api",
    "simulate": "murmura.simulation.api",
    "BatchHook": "murmura.simulation.attacks",
    "UpdateBatch": "murmura.simulation.attacks",
    "EventQueue": "murmura.simulation.clock",
    "VirtualClock": "murmura.simulation.clock",
    "SimulationConfig": "murmura.simulation.config",
    "SimulationData": "murmura.simulation.data",
    "load_local_dataset": "murmura.simulation.data",
    "load_simulation_data": "murmura.simulation.data",
    "natural": "murmura.simulation.data",
    "AlwaysOn": "murmura.simulation.devices",
    "Availability": "murmura.simulation.devices",
    "Churn": "murmura.simulation.devices",
    "DevicePopulation": "murmura.simulation.devices",
    "TraceAvailability": "murmura.simulation.devices",
    "Simulation": "murmura.simulation.engine",
    "SimulationResult": "murmura.simulation.engine",
    "client_id": "murmura.simulation.engine",
    "Executor": "murmura.simulation.execution",
    "Job": "murmura.simulation.execution",
    "JobResult": "murmura.simulation.execution",
    "LoopExecutor": "murmura.simulation.execution",
    "PoolExecutor": "murmura.simulation.execution",
    "RayExecutor": "murmura.simulation.ray_executor",
    "InMemoryTransport": "murmura.simulation.transport",
    "LocalAggregator": "murmura.simulation.transport",
    "VectorisationError": "murmura.simulation.vectorised",
    "VectorisedExecutor": "murmura.simulation.vectorised",
    "local_schedule": "murmura.simulation.vectorised",
    "ModelWire": "murmura.simulation.wire",
    "update_header_bytes": "murmura.simulation.wire",
    "update_wire_bytes": "murmura.simulation.wire",
}

__all__ = [
    "AlwaysOn",
    "Availability",
    "BatchHook",
    "Churn",
    "DevicePopulation",
    "EventQueue",
    "Executor",
    "InMemoryTransport",
    "Job",
    "JobResult",
    "LocalAggregator",
    "LoopExecutor",
    "ModelWire",
    "PoolExecutor",
    "RayExecutor",
    "Simulation",
    "SimulationConfig",
    "SimulationData",
    "SimulationResult",
    "TraceAvailability",
    "UpdateBatch",
    "VectorisationError",
    "VectorisedExecutor",
    "VirtualClock",
    "client_id",
    "load_local_dataset",
    "load_simulation_data",
    "local_schedule",
    "natural",
    "prepare_server",
    "simulate",
    "update_header_bytes",
    "update_wire_bytes",
]


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
