"""The collusion screen: spectral z-scores of residual histories, the screen's state, and what
it changes in ``default`` (distinct clients that push one shared objective lose their vote)."""

from __future__ import annotations

import numpy as np
import pytest

from murmura.aggregation import AggregationError, create_aggregator
from murmura.aggregation.collusion import CollusionScreen, ramp_weights
from murmura.aggregation.directions import spectral_z

P = 400


def residual_rows(rng: np.random.Generator, honest: int, colluders: int, *, dim: int = 64,
                  shared: float = 0.8) -> np.ndarray:
    """Unit-ish rows: honest ones point anywhere; colluders share one direction."""
    rows = rng.standard_normal((honest + colluders, dim))
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    common = rng.standard_normal(dim)
    common /= np.linalg.norm(common)
    rows[honest:] = shared * common + (1 - shared) * rows[honest:]
    return rows


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("colluders", [5, 9])
def test_a_group_sharing_a_direction_lands_together_in_the_positive_tail(seed: int,
                                                                          colluders: int) -> None:
    rows = residual_rows(np.random.default_rng(seed), 20, colluders)
    z = spectral_z(rows)
    assert np.all(z[20:] > 2.5), z[20:]
    assert np.max(z[:20]) < 2.0


@pytest.mark.parametrize("seed", range(5))
def test_a_pair_does_not_dominate_the_top_direction_but_shows_in_its_cosine(seed: int) -> None:
    # The limit the pair ramp is for: two colluders among 20 do not stand out along the top
    # direction, but their histories are far more alike than any honest pair's.
    rows = residual_rows(np.random.default_rng(seed), 20, 2)
    assert np.all(spectral_z(rows)[20:] < 2.0)
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    cos = unit @ unit.T
    np.fill_diagonal(cos, -1)
    assert cos[20, 21] > 0.9 > 0.5 > cos[:20, :20].max()


@pytest.mark.parametrize("seed", range(5))
def test_a_lone_outlier_is_not_scored_as_a_group(seed: int) -> None:
    # One row far from everyone makes the top direction on its own; scored against the
    # direction the others make, it stays near the crowd.
    rng = np.random.default_rng(seed)
    rows = residual_rows(rng, 24, 0)
    rows[0] *= 20.0
    assert spectral_z(rows)[0] < 2.0


def test_spectral_z_follows_the_rows_and_refuses_non_matrices() -> None:
    rows = residual_rows(np.random.default_rng(7), 15, 4)
    order = np.random.default_rng(8).permutation(len(rows))
    np.testing.assert_allclose(spectral_z(rows)[order], spectral_z(rows[order]), atol=1e-9)
    assert np.all(spectral_z(rows[:2]) == 0) and np.all(spectral_z(np.ones((5, 3))) == 0)
    with pytest.raises(AggregationError, match="matrix"):
        spectral_z(np.ones(5))


def test_ramp_weights_are_one_below_low_and_zero_from_high() -> None:
    np.testing.assert_allclose(ramp_weights([-3.0, 2.0, 2.25, 2.5, 9.0], low=2.0, high=2.5),
                               [1.0, 1.0, 0.5, 0.0, 0.0])


class Rounds:
    """Sketch-space rounds: a shared descent, a persistent per-client direction and noise;
    colluders add one shared objective of the size of an honest client's own direction."""

    def __init__(self, seed: int, honest: int = 20, colluders: int = 5, dim: int = 64,
                 pull: float = 2.0) -> None:
        self.rng = np.random.default_rng(seed)
        self.honest, self.colluders, self.dim = honest, colluders, dim
        n = honest + colluders
        self.own = self.rng.standard_normal((n, dim))
        self.goal = self.rng.standard_normal(dim) * pull
        self.ids = [f"h{i}" for i in range(honest)] + [f"a{i}" for i in range(colluders)]

    def round(self) -> np.ndarray:
        n = self.honest + self.colluders
        x = 3.0 + self.own + 0.5 * self.rng.standard_normal((n, self.dim))
        x[self.honest:] += self.goal
        return x


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("colluders", [3, 5, 9])
def test_the_screen_mutes_colluders_within_rounds_and_keeps_honest_clients(seed: int,
                                                                           colluders: int
                                                                           ) -> None:
    rounds = Rounds(seed, colluders=colluders)
    screen = CollusionScreen(rounds.dim, low=2.5, high=3.0)
    for _ in range(5):
        screen.observe(rounds.ids, rounds.round())
        w = screen.weights(rounds.ids)
    assert np.all(w[:20] == 1.0), w[:20]
    assert np.all(w[20:] == 0.0), w[20:]


@pytest.mark.parametrize("seed", range(4))
def test_with_no_colluders_honest_clients_keep_nearly_all_their_weight(seed: int) -> None:
    # Honest clients' persistent directions are unrelated: the top direction is the largest
    # honest variation and nobody stands far out along it.
    rounds = Rounds(seed, colluders=0)
    screen = CollusionScreen(rounds.dim, low=2.5, high=3.0)
    for _ in range(5):
        screen.observe(rounds.ids, rounds.round())
    assert screen.weights(rounds.ids).min() == 1.0
    assert max(screen.last_z.values()) < 2.5


def test_identities_that_switch_after_building_a_history_lose_weight_within_two_rounds(
        ) -> None:
    # Ten rounds of honest behaviour, then five identities send one shared objective: the
    # whole history moves slowly, the short one within two rounds.
    rounds = Rounds(5, colluders=5)
    goal = rounds.goal
    rounds.goal = np.zeros_like(goal)
    screen = CollusionScreen(rounds.dim)
    for _ in range(10):
        screen.observe(rounds.ids, rounds.round())
    assert screen.weights(rounds.ids)[20:].min() == 1.0
    rounds.goal = 4 * goal
    for _ in range(2):
        screen.observe(rounds.ids, rounds.round())
    w = screen.weights(rounds.ids)
    np.testing.assert_array_equal(w[20:], 0.0)
    assert np.all(w[:20] == 1.0)


def test_the_pair_ramp_mutes_two_colluders_the_top_direction_misses() -> None:
    rows = residual_rows(np.random.default_rng(3), 20, 2)
    ids = [f"c{i}" for i in range(22)]
    paired = CollusionScreen(rows.shape[1], low=3.0, high=4.0, pair_low=0.7, pair_high=0.8)
    paired.observe(ids, rows)
    w = paired.weights(ids)
    np.testing.assert_array_equal(w[20:], 0.0)
    assert np.all(w[:20] == 1.0)


def test_the_screen_waits_for_enough_clients_and_forgets() -> None:
    rounds = Rounds(0, honest=10, colluders=5)
    screen = CollusionScreen(rounds.dim)  # min_clients 16: 15 clients are too few to judge
    screen.observe(rounds.ids, rounds.round())
    np.testing.assert_array_equal(screen.weights(rounds.ids), 1.0)
    assert "a0" in screen
    screen.forget("a0")
    assert "a0" not in screen
    np.testing.assert_array_equal(screen.scores(["a0"]), 0.0)


def test_the_screen_state_round_trips_and_is_bounded() -> None:
    rounds = Rounds(1)
    screen = CollusionScreen(rounds.dim, max_clients=30)
    for _ in range(3):
        screen.observe(rounds.ids, rounds.round())
    again = CollusionScreen(rounds.dim, max_clients=30)
    again.load_state_dict(screen.state_dict())
    np.testing.assert_array_equal(again.scores(rounds.ids), screen.scores(rounds.ids))
    small = CollusionScreen(rounds.dim, max_clients=10)
    small.load_state_dict(screen.state_dict())
    assert list(small.state_dict()["ids"]) == rounds.ids[-10:]
    with pytest.raises(AggregationError, match="shape"):
        CollusionScreen(8).load_state_dict(screen.state_dict())


@pytest.mark.parametrize("kwargs", [{"dim": 0}, {"window": 2}, {"low": 3.0, "high": 2.0},
                                    {"min_clients": 2}, {"max_clients": 1},
                                    {"short_decay": 1.0}, {"pair_low": 0.5},
                                    {"pair_low": 0.9, "pair_high": 0.8}])
def test_bad_screen_options_are_refused(kwargs: dict[str, float]) -> None:
    options = {"dim": 16, **kwargs}
    with pytest.raises(AggregationError):
        CollusionScreen(**options)  # type: ignore[arg-type]


def test_observe_refuses_sketches_that_do_not_match() -> None:
    with pytest.raises(AggregationError, match="sketches"):
        CollusionScreen(16).observe(["a", "b"], np.zeros((3, 16)))


# -- in the default rule ---------------------------------------------------------------------


def model_rounds(seed: int, colluders: int, rounds: int = 6
                 ) -> tuple[list[np.ndarray], list[str], np.ndarray]:
    """Model-space rounds of 20 honest clients (shared descent, own direction, noise) and
    distinct colluders that add one shared objective on coordinates honest clients use too
    (a trigger where honest data lives): the per-coordinate stage only bounds its pull."""
    rng = np.random.default_rng(seed)
    n = 20 + colluders
    own = rng.standard_normal((n, P)) / np.sqrt(P)
    goal = np.zeros(P)
    goal[:40] = 2.0 / np.sqrt(40)
    out = []
    for _ in range(rounds):
        x = 1.0 / np.sqrt(P) + own + 0.3 * rng.standard_normal((n, P)) / np.sqrt(P)
        x[20:] += goal
        out.append(x.astype(np.float32))
    return out, [f"h{i}" for i in range(20)] + [f"a{i}" for i in range(colluders)], goal


@pytest.mark.parametrize("seed", range(3))
def test_default_with_the_screen_keeps_a_colluding_minority_out_of_the_aggregate(
        seed: int) -> None:
    xs, ids, goal = model_rounds(seed, colluders=5)
    pulls = {}
    for screen in (True, False):
        # the screen alone: the direction stage (its own tests) would also leave out up to a
        # quarter of the honest rows, which this test counts
        agg = create_aggregator("default", P, screen=screen, direction_trim=0.0)
        pull = 0.0
        for x in xs:
            for u, cid in zip(x, ids, strict=True):
                agg.add(u, 10.0, client_id=cid)
            out = agg.result()
            honest = x[:20].mean(axis=0)
            pull += float((out - honest) @ goal / np.linalg.norm(goal))
            agg.reset()
        pulls[screen] = pull
        if screen:
            np.testing.assert_array_equal(agg.last_effective[20:], 0.0)
            # isotropic honest directions put one honest client near the ramp at times
            assert (agg.last_effective[:20] == 1.0).sum() >= 19
            assert len(agg.last_voters) >= 19
    # Without the screen the colluders' pull accumulates; with it, it is the honest noise.
    assert pulls[False] > 5 * abs(pulls[True])


def test_default_state_carries_the_screen_and_screen_false_has_none() -> None:
    xs, ids, _ = model_rounds(3, colluders=4, rounds=2)
    agg = create_aggregator("default", P)
    for x in xs:
        for u, cid in zip(x, ids, strict=True):
            agg.add(u, 1.0, client_id=cid)
        agg.result()
        agg.reset()
    state = agg.state_dict()
    assert {"screen.ids", "screen.hist"} <= set(state)
    rebuilt = create_aggregator("default", P)
    rebuilt.load_state_dict(state)
    np.testing.assert_array_equal(rebuilt.screen.scores(ids), agg.screen.scores(ids))
    off = create_aggregator("default", P, screen=False)
    assert off.screen is None and not any(k.startswith("screen.") for k in off.state_dict())


def test_a_small_buffer_takes_its_centre_from_earlier_clients_too() -> None:
    # A full honest round, then a buffer of 5 in which 3 colluders are the majority: alone,
    # its median is theirs and their residuals hide the shared objective; with the newest
    # rows of the other clients in the centre, their residuals point along it.
    rounds = Rounds(6, colluders=3)
    goal = rounds.goal
    rounds.goal = np.zeros_like(goal)
    first = rounds.round()
    rounds.goal = goal
    second = rounds.round()
    small = [20, 21, 22, 0, 1]
    along = {}
    for extra in (0, 32):
        screen = CollusionScreen(rounds.dim, centre_extra=extra)
        screen.observe(rounds.ids, first)
        before = screen._hist.copy()
        screen.observe([rounds.ids[i] for i in small], second[small])
        steps = np.stack([screen._hist[screen._slots[rounds.ids[i]]]
                          - before[screen._slots[rounds.ids[i]]] for i in small[:3]])
        along[extra] = float(np.min(steps @ goal / np.linalg.norm(goal)))
    assert along[32] > 0.7 and along[32] > along[0] + 0.2, along


def test_last_effective_is_the_weight_each_row_finally_votes_with() -> None:
    # A boosted row keeps its Sybil and screen weights but is too long to vote: 0.
    xs, ids, _ = model_rounds(4, colluders=0, rounds=1)
    x = xs[0].copy()
    x[3] *= 10.0
    agg = create_aggregator("default", P)
    for u, cid in zip(x, ids, strict=True):
        agg.add(u, 1.0, client_id=cid)
    agg.result()
    assert agg.last_effective[3] == 0.0 and 3 not in agg.last_voters
    np.testing.assert_array_equal(agg.last_effective[np.asarray(agg.last_voters)], 1.0)
