"""PeerNode: what a peer accepts, how it mixes, and that a refusal changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.aggregation import SybilWeighting
from murmura.gossip import FailedPrecondition, GossipConfig, InvalidArgument, PeerNode, mix
from murmura.gossip.errors import ResourceExhausted
from murmura.gossip.node import MAX_DEAD
from murmura.protocols import ModelSpec, PeerInfo, TensorSpec

SPEC = ModelSpec((TensorSpec("w", (8,)),))


def node(**kw: object) -> PeerNode:
    return PeerNode("me", SPEC, GossipConfig(**kw), np.zeros(8, np.float32))  # type: ignore[arg-type]


def test_fedavg_mixing_is_the_mean_of_own_and_received_models() -> None:
    n = node()
    n.receive("a", 0, "m1", np.full(8, 3.0, np.float32))
    n.receive("b", 0, "m2", np.full(8, 6.0, np.float32))

    assert n.mix() == 2
    np.testing.assert_allclose(n.model, np.full(8, 3.0))
    assert not n.inbox


def test_a_retried_message_is_taken_once() -> None:
    n = node()
    assert n.receive("a", 0, "m1", np.ones(8, np.float32))
    assert not n.receive("a", 0, "m1", np.ones(8, np.float32))


@pytest.mark.parametrize(("model", "error", "match"), [
    (np.full(8, np.nan, np.float32), InvalidArgument, "non-finite"),
    (np.ones(9, np.float32), InvalidArgument, "expected 8"),
])
def test_bad_models_are_refused_and_change_nothing(model: np.ndarray, error: type,
                                                   match: str) -> None:
    n = node()
    n.receive("ok", 0, "m0", np.ones(8, np.float32))
    with pytest.raises(error, match=match):
        n.receive("bad", 0, "m1", model)
    assert set(n.inbox) == {"ok"}
    np.testing.assert_array_equal(n.model, np.zeros(8))


def test_wrong_spec_and_stale_rounds_are_refused_by_header() -> None:
    n = node(max_round_lag=2)
    n.round = 10
    with pytest.raises(FailedPrecondition, match="model spec"):
        n.check_model("a", 10, 1, "0123456789abcdef")
    with pytest.raises(FailedPrecondition, match="stale"):
        n.check_model("a", 7, 1, n.fingerprint)
    with pytest.raises(InvalidArgument, match="implausible"):
        n.check_model("a", 10**9, 1, n.fingerprint)


def test_sybil_weighting_mutes_clones_and_keeps_own_weight_one(rng: np.random.Generator) -> None:
    size = 4096
    own = np.zeros(size, np.float32)
    honest = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
    attack = rng.standard_normal(size).astype(np.float32) * 5
    clones = [attack + 0.01 * rng.standard_normal(size).astype(np.float32) for _ in range(6)]
    received = [(f"h{i}", m) for i, m in enumerate(honest)] + \
        [(f"s{i}", m) for i, m in enumerate(clones)]
    scorer = SybilWeighting(size, dim=256)

    out = mix(own, received, sybil=scorer)

    np.testing.assert_allclose(out, np.mean([own, *honest], axis=0), atol=1e-5)
    plain = mix(own, received)
    assert np.linalg.norm(plain - attack) < np.linalg.norm(out - attack)


def test_history_gossip_is_bounded_and_drops_malformed_records() -> None:
    import random

    sender = node(sybil=True, history_share=4, history_records=6)
    for i in range(10):
        sender.receive(f"p{i}", 0, f"m{i}", np.full(8, float(i), np.float32))
    assert len(sender.records) == 6  # oldest dropped

    offer = sender.history_offer(random.Random(0))
    assert len(offer) == 4
    receiver = PeerNode("other", SPEC, GossipConfig(sybil=True, history_share=4),
                        np.zeros(8, np.float32))
    dim = receiver.sybil.dim  # type: ignore[union-attr]
    bad = [("other", 0, np.ones(dim)), ("x", 0, np.ones(3)), ("y", 0, np.full(dim, np.nan))]
    assert receiver.take_history(bad) == 0
    assert receiver.take_history(offer) == 4
    assert receiver.take_history(offer) == 0  # already known


def test_malformed_entries_never_enter_the_view() -> None:
    # A shuffle partner's junk (found by tests/integration/test_gossip_fuzz.py) must not
    # spread: ids must be printable, 1..128 characters, addresses HOST:PORT.
    n = node()
    n.merge([PeerInfo("ok", "h:1"), PeerInfo("", "h:2"), PeerInfo("a\nb", "h:3"),
             PeerInfo("x" * 129, "h:4"), PeerInfo("no-port", "h"), PeerInfo("z", "h:" * 200)])
    n.heard_from(PeerInfo("\x00", "h:5"))
    assert n.view.ids() == ["ok"]


def test_departed_peers_are_remembered_up_to_a_bound() -> None:
    # Goodbyes are unauthenticated: a flood of them must not grow memory without bound.
    n = node()
    for i in range(MAX_DEAD + 10):
        n.mark_dead(f"p{i}", "h:1")
    assert len(n.dead) == MAX_DEAD
    assert "p0" not in n.dead and f"p{MAX_DEAD + 9}" in n.dead


def test_one_far_ahead_model_cannot_end_a_peers_run_but_a_majority_moves_it() -> None:
    n = node(rounds=30)
    n.round = 5
    n.receive("a", 5, "m1", np.ones(8, np.float32))
    n.receive("evil", 1005, "m2", np.ones(8, np.float32))  # within the plausible window
    n.mix()
    assert n.advance(5) == 6  # not 1005: the run goes on

    behind = node(rounds=30)  # a peer that fell behind hears from peers at round 20
    for k in range(3):
        behind.receive(f"p{k}", 20, f"q{k}", np.ones(8, np.float32))
    behind.mix()
    assert behind.advance(0) == 20


def test_the_inbox_holds_at_most_max_inbox_models() -> None:
    n = node(max_inbox=3)
    for i in range(3):
        n.receive(f"p{i}", 0, f"m{i}", np.ones(8, np.float32))
    with pytest.raises(ResourceExhausted, match="max_inbox"):
        n.receive("p3", 0, "m3", np.ones(8, np.float32))
    assert set(n.inbox) == {"p0", "p1", "p2"}
    assert n.receive("p0", 0, "m4", np.full(8, 2.0, np.float32))  # replaces its own slot
    n.mix()
    assert n.receive("p3", 1, "m5", np.ones(8, np.float32))  # mixing empties the inbox


def test_the_automatic_inbox_bound_leaves_room_for_what_a_round_can_bring() -> None:
    assert GossipConfig().inbox_limit() == 64
    assert GossipConfig(topology="k-regular", degree=99, view_size=128).inbox_limit() == 256
    assert GossipConfig(max_inbox=5).inbox_limit() == 5
    with pytest.raises(ValueError, match="max_inbox"):
        GossipConfig(max_inbox=-1)


def test_mixing_can_weight_models_by_their_examples() -> None:
    n = node(weight_by_examples=True)
    n.own_examples = 1
    n.receive("a", 0, "m1", np.full(8, 4.0, np.float32), num_examples=3)
    n.mix()
    np.testing.assert_allclose(n.model, np.full(8, 3.0))  # (0 x 1 + 4 x 3) / 4
    plain = node()
    plain.receive("a", 0, "m1", np.full(8, 4.0, np.float32), num_examples=3)
    plain.mix()
    np.testing.assert_allclose(plain.model, np.full(8, 2.0))  # equal weights: (0 + 4) / 2


def test_gossiped_records_reach_the_collusion_screen() -> None:
    # A peer hears first-hand from a few peers per round; the records its shuffle partners
    # pass on enter the screen as one batch, so it tracks (and can judge) peers it never
    # received a model from.
    n = node(sybil=True, history_share=16)
    assert n.sybil is not None and n.sybil.screen is not None
    rng = np.random.default_rng(5)
    dim = n.sybil.dim
    n.take_history([(f"far{i}", 0, rng.standard_normal(dim)) for i in range(8)])
    n.receive("near", 0, "m1", rng.standard_normal(8).astype(np.float32))
    n.receive("nearer", 0, "m2", rng.standard_normal(8).astype(np.float32))
    assert n.mix() == 2
    assert all(f"far{i}" in n.sybil.screen for i in range(8))
    assert "near" in n.sybil.screen and "nearer" in n.sybil.screen


def test_neighbours_trust_ramps_up_over_the_first_mixings() -> None:
    n = node(sybil=True, trust_warmup=4)
    scales = []
    for r in range(6):
        n.receive("a", r, f"m{r}", np.full(8, 2.0, np.float32))
        n.mix()
        scales.append(n.trust_scale())  # the factor the mixing just used
        n.round += 1
    assert scales == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    first = node(sybil=True, trust_warmup=4)
    first.receive("a", 0, "m0", np.full(8, 2.0, np.float32))
    first.mix()  # own weight 1, the neighbour 0.25: 0.25 * 2 / 1.25
    np.testing.assert_allclose(first.model, 0.4, rtol=1e-6)
    assert node(sybil=True, trust_warmup=0).trust_scale() == 1.0
    with pytest.raises(ValueError, match="trust_warmup"):
        GossipConfig(trust_warmup=-1)
