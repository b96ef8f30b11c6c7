"""Pure aggregation algorithms on flat float32 vectors: no I/O, no network, no server types."""

# Importing the rule modules registers them (fedavg, clip, median, trimmed-mean, krum,
# multi-krum, centered-clip, flame, dnc, sybil, sybil-cclip, default).
from murmura.aggregation import filtering, robust, sybil  # noqa: F401
from murmura.aggregation.base import (
    AggregationError,
    Aggregator,
    BufferedAggregator,
    FlatVector,
    aggregation_rule,
    available_aggregators,
    create_aggregator,
    register_aggregator,
)
from murmura.aggregation.collusion import CollusionScreen
from murmura.aggregation.fedavg import WeightedMean, weighted_mean
from murmura.aggregation.fedbuff import FedBuff, StaleUpdateError
from murmura.aggregation.filtering import DivideAndConquer, Flame
from murmura.aggregation.optimizers import (
    FedAdam,
    FedAvgM,
    FedAvgOpt,
    FedYogi,
    ServerOptimizer,
    available_optimizers,
    create_optimizer,
)
from murmura.aggregation.partial import ExactSum, Partial
from murmura.aggregation.robust import (
    AdaptiveClipping,
    CenteredClipping,
    CoordinateMedian,
    Krum,
    MultiKrum,
    TrimmedMean,
)
from murmura.aggregation.staleness import (
    Constant,
    Hinge,
    Polynomial,
    StalenessFn,
    staleness_function,
)
from murmura.aggregation.sybil import RobustDefault, SybilCenteredClip, SybilMean, SybilWeighting

__all__ = [
    "AdaptiveClipping",
    "AggregationError",
    "CenteredClipping",
    "CollusionScreen",
    "CoordinateMedian",
    "DivideAndConquer",
    "Flame",
    "Krum",
    "MultiKrum",
    "RobustDefault",
    "SybilCenteredClip",
    "SybilMean",
    "SybilWeighting",
    "TrimmedMean",
    "Aggregator",
    "BufferedAggregator",
    "Constant",
    "ExactSum",
    "FedAdam",
    "FedAvgM",
    "FedAvgOpt",
    "FedBuff",
    "FedYogi",
    "FlatVector",
    "Hinge",
    "Partial",
    "Polynomial",
    "ServerOptimizer",
    "StaleUpdateError",
    "StalenessFn",
    "WeightedMean",
    "aggregation_rule",
    "available_aggregators",
    "available_optimizers",
    "create_aggregator",
    "create_optimizer",
    "register_aggregator",
    "staleness_function",
    "weighted_mean",
]
