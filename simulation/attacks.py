"""Attacks in a simulation: per-client attacks as a deployed malicious client runs them, and a
hook for harness-level attacks that need more than one client.

* **Per client**: ``Simulation(attacks={client index: Attack})`` with the
  :class:`~murmura.client.malicious.Attack` a real malicious client runs
  (:func:`~murmura.client.malicious.make_attack`). Its ``data`` transform applies to that
  client's share, once, before the run (as ``murmura client --attack`` transforms its share);
  its ``update`` transform applies to each update the client trains, before encoding (where
  :class:`~murmura.client.ClientRuntime` calls its ``update_hook``).
* **Harness level**: ``Simulation(update_hook=hook)``. Attacks such as ALIE and IPM need the
  honest updates in flight, and a Sybil flood sends one poisoned update from many identities;
  no single client can run them. The engine trains clients in batches (every client that
  pulled since the last batch); ``hook(batch)`` sees each :class:`UpdateBatch` after the
  per-client transforms and returns the updates it replaces, keyed by client index.

Without attacks and without a hook the engine takes none of these paths.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from murmura.client.malicious import Attack
from murmura.protocols import FlatVector
from murmura.simulation.data import SimulationData
from murmura.tasks import ArrayDataset, Task

__all__ = ["BatchHook", "UpdateBatch", "check_attacks", "check_update", "poison_data"]


@dataclass(frozen=True)
class UpdateBatch:
    """One training batch's updates, after per-client attacks and before encoding.

    Entry ``i`` of every tuple belongs to client ``clients[i]``; the order is the engine's
    (deterministic) batch order. ``updates`` are read-only: a hook returns replacements instead
    of writing into them. ``bases`` are the global vectors the clients trained from (shared
    between clients that pulled the same version; read-only).
    """

    time_s: float
    clients: tuple[int, ...]
    versions: tuple[int, ...]
    rounds: tuple[int, ...]
    num_examples: tuple[int, ...]
    bases: tuple[FlatVector, ...]
    updates: tuple[FlatVector, ...]

    def __len__(self) -> int:
        return len(self.clients)


#: ``hook(batch) -> {client index: replacement update}`` (``None`` or ``{}``: no change).
BatchHook = Callable[[UpdateBatch], Mapping[int, FlatVector] | None]


def check_attacks(attacks: Mapping[int, Attack] | None, clients: int) -> dict[int, Attack]:
    """The attacks as a dict keyed by client index; a clear error for a bad key or value."""
    out: dict[int, Attack] = {}
    for c, attack in (attacks or {}).items():
        if isinstance(c, bool) or not isinstance(c, int | np.integer) or not 0 <= c < clients:
            raise ValueError(f"attacks are keyed by client index 0..{clients - 1}; got {c!r}")
        if not isinstance(attack, Attack):
            raise TypeError(f"attacks[{c}] must be a murmura.client.malicious.Attack (see "
                            f"make_attack), got {type(attack).__name__}")
        if attack.data is not None or attack.update is not None:
            out[int(c)] = attack
    return out


def check_update(update: object, size: int, client: int, source: str) -> FlatVector:
    """``update`` as a flat float32 vector of ``size`` values, or a ValueError naming
    ``source`` (the attack or the hook that produced it)."""
    u = np.asarray(update)
    if u.shape != (size,):
        raise ValueError(f"{source} gave client {client} an update of shape {u.shape}; the "
                         f"model has ({size},) values")
    if not (np.issubdtype(u.dtype, np.floating) or np.issubdtype(u.dtype, np.integer)):
        raise ValueError(f"{source} gave client {client} an update of dtype {u.dtype}; "
                         "expected float32")
    return u.astype(np.float32, copy=False)


def poison_data(data: SimulationData, attacks: Mapping[int, Attack]) -> SimulationData:
    """``data`` with each attacked client's share replaced by its ``Attack.data`` transform.

    Shares are index arrays into one training set, so the transformed shares are appended to
    a copy of it and the attacked clients index the new rows. Every executor (loop, pool,
    vectorised) then trains them without knowing about attacks. Returns ``data`` itself when
    no attack transforms data.
    """
    poisoned = sorted(c for c, a in attacks.items() if a.data is not None)
    if not poisoned:
        return data
    train = data.train
    xs, ys = [train.x], [train.y]
    shares = list(data.shares)
    offset = len(train)
    for c in poisoned:
        transform = attacks[c].data
        assert transform is not None
        own = transform(train.subset(data.shares[c]))
        if not isinstance(own, ArrayDataset):
            raise TypeError(f"the data attack of client {c} returned "
                            f"{type(own).__name__}, expected an ArrayDataset")
        if len(own) == 0 or own.x.shape[1:] != train.x.shape[1:]:
            raise ValueError(f"the data attack of client {c} returned {len(own)} examples of "
                             f"shape {own.x.shape[1:]}; expected at least one of shape "
                             f"{train.x.shape[1:]}")
        shares[c] = np.arange(offset, offset + len(own), dtype=np.int64)
        offset += len(own)
        xs.append(np.asarray(own.x, dtype=train.x.dtype))
        ys.append(np.asarray(own.y, dtype=train.y.dtype))
    task = data.task
    train = ArrayDataset(np.concatenate(xs), np.concatenate(ys))
    return SimulationData(Task(task.config, train, task.test, task.model_factory), shares,
                          f"{data.source}; {len(poisoned)} clients' data poisoned",
                          data.groups)
