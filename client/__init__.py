"""The client runtime: trainers, the transport to the aggregator, and the retrying loop."""

from typing import TYPE_CHECKING

from murmura.protocols.lazy import lazy_getattr

if TYPE_CHECKING:
    from murmura.client.build import build_client
    from murmura.client.config import ClientConfig
    from murmura.client.retry import Backoff, RetryPolicy, jitter_rng
    from murmura.client.rules import (
        UpdateIds,
        after_refusal,
        codec_choice,
        encoder_seed,
        make_encoder,
    )
    from murmura.client.runtime import ClientRuntime, ClientStats
    from murmura.client.torch_trainer import TorchTrainer
    from murmura.client.trainer import FunctionTrainer, Trainer, TrainResult, delta_of
    from murmura.client.transport import GrpcTransport, RemoteError, Transport
    from murmura.client.zo import SettingsTrainer, ZOTrainer, make_trainer

#: Where each name lives, imported on first use: a submodule (a config the command-line
#: parser reads) can then be imported without torch and the rest of the package.
_LAZY = {
    "build_client": "murmura.client.build",
    "ClientConfig": "murmura.client.config",
    "Backoff": "murmura.client.retry",
    "RetryPolicy": "murmura.client.retry",
    "jitter_rng": "murmura.client.retry",
    "UpdateIds": "murmura.client.rules",
    "after_refusal": "murmura.client.rules",
    "codec_choice": "murmura.client.rules",
    "encoder_seed": "murmura.client.rules",
    "make_encoder": "murmura.client.rules",
    "ClientRuntime": "murmura.client.runtime",
    "ClientStats": "murmura.client.runtime",
    "TorchTrainer": "murmura.client.torch_trainer",
    "FunctionTrainer": "murmura.client.trainer",
    "Trainer": "murmura.client.trainer",
    "TrainResult": "murmura.client.trainer",
    "delta_of": "murmura.client.trainer",
    "GrpcTransport": "murmura.client.transport",
    "RemoteError": "murmura.client.transport",
    "Transport": "murmura.client.transport",
    "SettingsTrainer": "murmura.client.zo",
    "ZOTrainer": "murmura.client.zo",
    "make_trainer": "murmura.client.zo",
}

__all__ = [
    "Backoff",
    "ClientConfig",
    "ClientRuntime",
    "ClientStats",
    "FunctionTrainer",
    "GrpcTransport",
    "RemoteError",
    "RetryPolicy",
    "TorchTrainer",
    "TrainResult",
    "Trainer",
    "SettingsTrainer",
    "Transport",
    "UpdateIds",
    "ZOTrainer",
    "after_refusal",
    "build_client",
    "codec_choice",
    "delta_of",
    "encoder_seed",
    "jitter_rng",
    "make_encoder",
    "make_trainer",
]


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
