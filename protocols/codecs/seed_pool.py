"""FedKSeed's shared pool of K seeds: the pool, and the global model it defines.

Clients of a pool session draw every step seed from one pool of K seeds known to all peers, so
the server can keep one cumulative coefficient per pool seed, and a client that missed any
number of rounds catches up by downloading those K scalars instead of the model (Qin et al.,
https://arxiv.org/abs/2312.06353). The codec option ``pool`` turns it on
(:meth:`murmura.protocols.codecs.seed.SeedCodec.pool`); the steps are applied with
:mod:`murmura.protocols.codecs.seed_steps`.
"""

from __future__ import annotations

from typing import overload

import numpy as np
import numpy.typing as npt
import torch

from murmura.protocols import prng
from murmura.protocols.codecs.base import CodecError, FlatVector
from murmura.protocols.codecs.seed_steps import APPLY_BLOCK, ZOSteps, apply_steps

__all__ = ["SeedPool", "apply_pool", "pool_model"]


class SeedPool:
    """FedKSeed's pool of K seeds shared by every client, https://arxiv.org/abs/2312.06353.

    Clients draw their step seeds from the pool, so the sum of all coefficients ever applied
    along pool seed ``j`` is one number per seed. The server keeps those sums (float64) and
    publishes them as a float32 vector ``C`` of length K; the global model is *defined* as
    ``pool_model(base, pool, C)``, the K canonical steps of :func:`apply_pool` applied to the
    agreed base model. A client that missed any number of rounds downloads ``C`` (4K bytes) and
    rebuilds exactly the server's model.

    Seeds are ``derive_seed(base_seed, j)`` narrowed to ``seed_bits``, for ``j = 0, 1, ...``,
    skipping repeats until K distinct seeds are found.
    """

    def __init__(self, k: int, base_seed: int, *, seed_bits: int = 32) -> None:
        if k < 1:
            raise ValueError(f"pool size must be positive, got {k}")
        if seed_bits not in (32, 64):
            raise ValueError(f"seed_bits must be 32 or 64, got {seed_bits}")
        mask, index = (1 << seed_bits) - 1, 0
        seeds: list[int] = []
        position: dict[int, int] = {}
        while len(seeds) < k:
            seed = prng.derive_seed(base_seed, index) & mask
            index += 1
            if seed not in position:
                position[seed] = len(seeds)
                seeds.append(seed)
        self.seeds: tuple[int, ...] = tuple(seeds)
        self.base_seed = base_seed
        self._position = position

    def __len__(self) -> int:
        return len(self.seeds)

    def index(self, seed: int) -> int:
        """Position of ``seed`` in the pool; ValueError when it is not a pool seed."""
        try:
            return self._position[int(seed)]
        except KeyError:
            raise ValueError(f"seed {seed} is not in the pool") from None

    def sample(self, rng: np.random.Generator) -> int:
        """A pool seed drawn uniformly, as FedKSeed's clients do each step."""
        return self.seeds[int(rng.integers(len(self.seeds)))]

    def contribution(self, steps: ZOSteps) -> npt.NDArray[np.float64]:
        """Per pool seed, the sum of the coefficients a decoded step log applied along it."""
        out = np.zeros(len(self.seeds), dtype=np.float64)
        try:
            where = np.fromiter((self._position[int(s)] for s in steps.seeds), dtype=np.int64,
                                count=len(steps))
        except KeyError as err:
            raise CodecError(f"codec 'seed': step seed {err.args[0]} is not in the pool") from None
        np.add.at(out, where, steps.coefficients.astype(np.float64))
        return out


def _check_cumulative(pool: SeedPool, cumulative: npt.ArrayLike) -> npt.NDArray[np.float32]:
    values = np.asarray(cumulative)
    if values.dtype != np.float32 or values.shape != (len(pool),):
        raise ValueError(f"cumulative must be float32 of shape ({len(pool)},), got "
                         f"{values.dtype} {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError("cumulative holds NaN or Inf")
    return values


def apply_pool(theta: torch.Tensor, pool: SeedPool, cumulative: npt.ArrayLike, *,
               block: int = APPLY_BLOCK) -> None:
    """The canonical pool step: ``apply_step(theta, pool.seeds[j], cumulative[j])`` for j = 0..K-1.

    ``cumulative`` is the published float32 vector; zeros are skipped. Because the global model
    is defined by this function applied to the base model, catch-up is exact by construction.
    """
    apply_steps(theta, pool.seeds, _check_cumulative(pool, cumulative), block=block)


@overload
def pool_model(base: torch.Tensor, pool: SeedPool, cumulative: npt.ArrayLike) -> torch.Tensor: ...
@overload
def pool_model(base: FlatVector, pool: SeedPool, cumulative: npt.ArrayLike) -> FlatVector: ...
def pool_model(base: torch.Tensor | FlatVector, pool: SeedPool,
               cumulative: npt.ArrayLike) -> torch.Tensor | FlatVector:
    """The global model of a pool session: a copy of ``base`` with :func:`apply_pool` applied."""
    if isinstance(base, torch.Tensor):
        theta = base.detach().to(torch.float32).clone().contiguous()
        apply_pool(theta, pool, cumulative)
        return theta
    theta_np = np.array(base, dtype=np.float32, copy=True).reshape(-1)
    apply_pool(torch.from_numpy(theta_np), pool, cumulative)
    return theta_np
