"""ModelSpec: the names, shapes and dtypes that turn one flat float32 vector into a model.

Everything between the edges of Murmura (codecs, aggregation, checkpoints, simulation) works on
one contiguous float32 vector; only the edges convert to and from ``torch.nn.Module``. The spec
covers the module's ``state_dict`` entries with a floating dtype (parameters and buffers such as
BatchNorm running statistics); integer buffers like ``num_batches_tracked`` stay local. Buffers
are marked (:attr:`TensorSpec.buffer`): the server averages them instead of stepping them like
parameters (:class:`~murmura.server.model.BufferRule`).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

FlatVector = npt.NDArray[np.float32]

_FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor inside the flat vector."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    #: A module buffer (BatchNorm running statistics), not a trainable parameter. Not part of
    #: the fingerprint or of equality, and not sent on the wire: only the side that built the
    #: spec from its module knows it, which is the side that makes versions.
    buffer: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tensor name must not be empty")
        if any(int(d) < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r} has a negative dimension: {self.shape}")
        if self.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"tensor {self.name!r} has unsupported dtype {self.dtype!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelSpec:
    """Ordered tensor specs; offsets into the flat vector follow from the order."""

    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("tensor names in a ModelSpec must be unique")

    @functools.cached_property
    def size(self) -> int:
        """Number of float32 values in the flat vector (computed once: hot paths ask often)."""
        return sum(t.numel for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return 4 * self.size

    def offsets(self) -> list[int]:
        out, pos = [], 0
        for t in self.tensors:
            out.append(pos)
            pos += t.numel
        return out

    @functools.cached_property
    def buffer_index(self) -> npt.NDArray[np.int64]:
        """Coordinates of the buffers in the flat vector (empty for a model without any)."""
        return self._index(lambda t: t.buffer)

    @functools.cached_property
    def variance_index(self) -> npt.NDArray[np.int64]:
        """Coordinates of the buffers that are variances (``running_var``): never negative."""
        return self._index(lambda t: t.buffer and t.name.rsplit(".", 1)[-1] == "running_var")

    def _index(self, keep: Callable[[TensorSpec], bool]) -> npt.NDArray[np.int64]:
        parts = [np.arange(off, off + t.numel, dtype=np.int64)
                 for t, off in zip(self.tensors, self.offsets(), strict=True) if keep(t)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def fingerprint(self) -> str:
        """Stable digest of names, shapes and dtypes: two peers agree on a model iff equal."""
        h = hashlib.sha256()
        for t in self.tensors:
            h.update(f"{t.name}:{','.join(map(str, t.shape))}:{t.dtype};".encode())
        return h.hexdigest()[:16]

    # -- torch edges --------------------------------------------------------------------------

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> ModelSpec:
        buffers = {name for name, _ in module.named_buffers()}
        return cls(
            tuple(
                TensorSpec(name, tuple(int(d) for d in value.shape), _dtype_name(value.dtype),
                           buffer=name in buffers)
                for name, value in _float_state(module)
            )
        )

    def flatten(self, module: torch.nn.Module) -> FlatVector:
        """Copy the module's floating state into a new float32 vector (CPU)."""
        out = np.empty(self.size, dtype=np.float32)
        state = dict(_float_state(module))
        for t, off in zip(self.tensors, self.offsets(), strict=False):
            value = state.get(t.name)
            if value is None or tuple(value.shape) != t.shape:
                raise ValueError(f"module does not match spec at tensor {t.name!r}")
            out[off : off + t.numel] = value.detach().reshape(-1).to("cpu", torch.float32).numpy()
        return out

    def load_into(self, module: torch.nn.Module, vector: FlatVector) -> None:
        """Write a flat vector into the module's tensors in place (any device, any dtype)."""
        self.check_vector(vector)
        state = dict(_float_state(module))
        flat = torch.from_numpy(np.ascontiguousarray(vector, dtype=np.float32))
        with torch.no_grad():
            for t, off in zip(self.tensors, self.offsets(), strict=False):
                target = state[t.name]
                target.copy_(flat[off : off + t.numel].view(t.shape))

    def unflatten(self, vector: FlatVector) -> dict[str, npt.NDArray[np.float32]]:
        """Views of the flat vector, one per tensor, shaped as the spec says (no copy)."""
        self.check_vector(vector)
        return {
            t.name: vector[off : off + t.numel].reshape(t.shape)
            for t, off in zip(self.tensors, self.offsets(), strict=False)
        }

    def check_vector(self, vector: FlatVector) -> None:
        if vector.ndim != 1 or vector.shape[0] != self.size:
            raise ValueError(f"expected a flat vector of {self.size} values, got {vector.shape}")


def _float_state(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, value in module.state_dict(keep_vars=True).items():
        if torch.is_floating_point(value):
            yield name, value.data if isinstance(value, torch.nn.Parameter) else value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
