"""The client runtime: trainers, the transport to the aggregator, and the retrying loop."""

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
