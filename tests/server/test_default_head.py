"""The server tells the `default` rule where the model's output layer is (``head``) when only
``head_c`` is configured: the rule sees a flat vector, the spec knows the layers."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.protocols import ModelSpec, TensorSpec
from murmura.server import AggregatorCore, ServerConfig
from murmura.server.policy import output_layer_values

MLP = ModelSpec((TensorSpec("0.weight", (4, 3)), TensorSpec("0.bias", (4,)),
                 TensorSpec("2.weight", (2, 4)), TensorSpec("2.bias", (2,))))


@pytest.mark.parametrize("spec, values", [
    (MLP, 2 * 4 + 2),
    (ModelSpec((TensorSpec("w", (3, 5)),)), 15),                        # no bias
    (ModelSpec((TensorSpec("conv", (2, 1, 3, 3)), TensorSpec("fc", (4, 18)),
                TensorSpec("fc.b", (4,)), TensorSpec("bn.mean", (4,)))), 4 * 18 + 4 + 4),
    (ModelSpec((TensorSpec("w", (7,)),)), 0),                           # a plain vector
])
def test_the_output_layer_is_the_last_matrix_and_what_follows(spec, values) -> None:
    assert output_layer_values(spec) == values


def _rule(spec: ModelSpec = MLP, **options: str):  # noqa: ANN202
    cfg = ServerConfig.from_flat(defense="default", defense_options=options, require_identity=False)
    core = AggregatorCore(cfg, spec, np.zeros(spec.size, np.float32))
    return core.policy.aggregator


def test_a_server_clips_the_output_layer_more_loosely_unless_told_otherwise() -> None:
    rule = _rule()  # nothing set: the measured layered constants
    assert (rule.huber_c, rule.head, rule.head_c) == (1.0, 10, 2.5)
    rule = _rule(head_c="3")  # head_c alone: the head from the spec, the rule's huber_c
    assert (rule.huber_c, rule.head, rule.head_c) == (1.345, 10, 3.0)
    rule = _rule(huber_c="1.2")  # one constant asked for: one constant everywhere
    assert (rule.huber_c, rule.head, rule.head_c) == (1.2, 0, None)
    assert _rule(head_c="2.5", head="3").head == 3  # an explicit head wins
    rule = _rule(ModelSpec((TensorSpec("w", (7,)),)))  # no layers to tell apart
    assert (rule.huber_c, rule.head, rule.head_c) == (1.345, 0, None)


def test_a_head_that_is_not_a_count_is_refused_at_configuration() -> None:
    with pytest.raises(ValueError, match="head must be a whole number"):
        ServerConfig.from_flat(defense="default", defense_options={"head": "last"})
