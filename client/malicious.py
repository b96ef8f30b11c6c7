"""Opt-in malicious behaviour for a real client, for integration tests and red-team runs.

A malicious client runs the normal runtime and poisons either its data (targeted label
flipping) or its update just before encoding (sign flipping, boosting, noise). The simulator
takes the same :class:`Attack` per virtual client (``Simulation(attacks=...)``), so a simulated
attacker poisons exactly as a deployed one. Attacks that need the honest clients' updates
(ALIE, IPM) or many identities (Sybil clones) live in the simulation harness, which sees every
client (``Simulation(update_hook=...)``); they use the functions of
:mod:`murmura.client.attacks`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from murmura.client import attacks
from murmura.protocols import FlatVector
from murmura.tasks import ArrayDataset

ATTACKS = ("", "label-flip", "backdoor", "sign-flip", "scale", "noise")

#: The options each attack reads (``--attack-option KEY=VALUE``): an unknown one is refused
#: with this list, so a typo never runs an attack with its defaults.
ATTACK_OPTIONS: dict[str, tuple[str, ...]] = {
    "": (), "label-flip": ("source", "target"),
    "backdoor": ("target", "fraction", "patch", "boost"), "sign-flip": ("scale",),
    "scale": ("factor",), "noise": ("std", "relative"),
}


@dataclass(frozen=True)
class Attack:
    """What a malicious client does: a data transform and/or an update transform."""

    data: Callable[[ArrayDataset], ArrayDataset] | None = None
    update: Callable[[FlatVector], FlatVector] | None = None


def make_attack(name: str, options: dict[str, str] | None = None, *, seed: int = 0) -> Attack:
    """``label-flip`` (source, target), ``backdoor`` (target, fraction, patch, boost),
    ``sign-flip`` (scale), ``scale`` (factor), ``noise`` (std, relative); an empty name is an
    honest client.

    ``backdoor`` stamps a ``patch`` x ``patch`` pixel square (value 1) into the bottom-right
    corner of a ``fraction`` of the client's own (square, flattened) images and relabels them
    ``target``; ``boost`` > 1 also scales each update by that factor (model replacement).

    ``noise`` sends N(0, std^2) noise in place of the update; with ``relative=1`` the std is a
    multiple of the update's root mean square, so the noise has about ``std`` times the
    update's norm whatever the model's scale.
    """
    opts = dict(options or {})

    def number(key: str, default: float) -> float:
        try:
            return float(opts.pop(key, default))
        except ValueError:
            raise ValueError(f"attack {name!r}: option {key} is not a number") from None

    if name not in ATTACKS:
        known = ", ".join(a for a in ATTACKS if a)
        raise ValueError(f"unknown attack {name!r}; use one of {known}")
    attack = Attack()
    if name == "label-flip":
        source, target = int(number("source", 1)), int(number("target", 7))
        attack = Attack(data=lambda d: ArrayDataset(
            d.x, np.asarray(attacks.flip_labels(d.y, source, target), dtype=np.int64)))
    elif name == "backdoor":
        target, fraction = int(number("target", 7)), number("fraction", 0.5)
        patch, boost = int(number("patch", 2)), number("boost", 1.0)
        if not 0 < fraction <= 1:
            raise ValueError(f"attack 'backdoor': fraction must be in (0, 1], got {fraction:g}")
        rng = np.random.default_rng(seed)

        def poison(d: ArrayDataset) -> ArrayDataset:
            trigger = attacks.corner_trigger(int(np.prod(d.x.shape[1:])), size=patch)
            flat = np.asarray(d.x, dtype=np.float32).reshape(len(d.x), -1)
            x, y = attacks.backdoor_data(flat, d.y, trigger=trigger, target=target,
                                         fraction=fraction, rng=rng)
            return ArrayDataset(x.reshape(d.x.shape).astype(d.x.dtype, copy=False), y)

        boost_update = None if boost == 1.0 else (
            lambda u: attacks.scale_update(u, factor=boost))
        attack = Attack(data=poison, update=boost_update)
    elif name == "sign-flip":
        scale = number("scale", 1.0)
        attack = Attack(update=lambda u: attacks.sign_flip(u, scale=scale))
    elif name == "scale":
        factor = number("factor", 10.0)
        attack = Attack(update=lambda u: attacks.scale_update(u, factor=factor))
    elif name == "noise":
        std = number("std", 1.0)
        relative = number("relative", 0.0)
        if relative not in (0.0, 1.0):
            raise ValueError(f"attack 'noise': option relative must be 0 or 1, got {relative:g}")
        rng = np.random.default_rng(seed)

        def noise(u: FlatVector) -> FlatVector:
            scale = float(np.sqrt(np.mean(np.square(u, dtype=np.float64)))) if relative else 1.0
            return attacks.gaussian_noise(u, std=std * scale, rng=rng)

        attack = Attack(update=noise)
    if opts:
        valid = ATTACK_OPTIONS[name]
        raise ValueError(f"attack {name!r}: unknown option{'s' * (len(opts) > 1)} "
                         f"{', '.join(map(repr, sorted(opts)))}; "
                         + (f"its options: {', '.join(valid)}" if valid
                            else "it takes no options"))
    return attack
