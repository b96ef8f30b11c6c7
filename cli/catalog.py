"""The values ``--help`` lists for the registry-backed options, known without loading torch.

The codec and aggregation registries fill as their modules load, and those modules load torch
(seconds). Until they are loaded, ``--help`` lists the built-in names held here; once they are
(an app file may have registered more), it lists the live registries. ``tests/cli`` keeps each
built-in list equal to what the code accepts.
"""

from __future__ import annotations

import sys

__all__ = ["AMP_MODES", "ATTACKS", "BUILTIN_CODECS", "BUILTIN_OPTIMIZERS", "BUILTIN_RULES",
           "DEVICES", "codecs", "optimizers", "rules"]

BUILTIN_CODECS = ("dense-f16", "dense-f32", "int4", "int8", "partial", "proj", "seed", "sign",
                  "topk")
BUILTIN_RULES = ("centered-clip", "clip", "default", "dnc", "fedavg", "flame", "krum", "median",
                 "multi-krum", "sybil", "sybil-cclip", "trimmed-mean")
BUILTIN_OPTIMIZERS = ("fedadam", "fedavg", "fedavgm", "fedyogi")
#: murmura.client.malicious.ATTACKS, murmura.edge.DEVICES and murmura.edge.AMP_MODES
ATTACKS = ("", "label-flip", "backdoor", "sign-flip", "scale", "noise")
DEVICES = ("auto", "cpu", "cuda", "mps")
AMP_MODES = ("auto", "off", "bf16", "fp16")


def codecs() -> list[str]:
    """Codec names: the registry's if it is loaded, else the built-in ones."""
    if "murmura.protocols.codecs" in sys.modules:
        from murmura.protocols.codecs import available_codecs

        return available_codecs()
    return sorted(BUILTIN_CODECS)


def rules() -> list[str]:
    """Aggregation rule names: the registry's if it is loaded, else the built-in ones."""
    if "murmura.aggregation" in sys.modules:
        from murmura.aggregation import available_aggregators

        return available_aggregators()
    return sorted(BUILTIN_RULES)


def optimizers() -> list[str]:
    """Server optimizer names: the registry's if it is loaded, else the built-in ones."""
    if "murmura.aggregation" in sys.modules:
        from murmura.aggregation import available_optimizers

        return available_optimizers()
    return sorted(BUILTIN_OPTIMIZERS)
