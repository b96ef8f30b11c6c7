"""Simulation: thousands of virtual clients on one machine, in virtual time, through the real
aggregator core, codecs and trainers (vectorised with torch.func where the model allows)."""

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
