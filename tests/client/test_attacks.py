"""Update-level attacks: the vectors they send, their seeding, and that inputs stay untouched."""

from __future__ import annotations

from statistics import NormalDist

import numpy as np
import pytest

from murmura.client import attacks


@pytest.fixture
def honest() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((8, 50)).astype(np.float32)


def test_sign_flip_and_scaling_send_multiples_of_the_update(honest) -> None:
    u = honest[0]
    np.testing.assert_allclose(attacks.sign_flip(u), -u)
    np.testing.assert_allclose(attacks.sign_flip(u, scale=4.0), -4 * u)
    np.testing.assert_allclose(attacks.scale_update(u, factor=10.0), 10 * u)
    assert attacks.sign_flip(u).dtype == np.float32


def test_gaussian_noise_is_seeded_and_replaces_or_adds(honest) -> None:
    u = honest[0]
    a = attacks.gaussian_noise(u, std=2.0, rng=np.random.default_rng(1))
    b = attacks.gaussian_noise(u, std=2.0, rng=np.random.default_rng(1))
    c = attacks.gaussian_noise(u, std=2.0, rng=np.random.default_rng(1), additive=True)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(c, u + a, rtol=1e-6)
    assert 1.0 < float(np.std(attacks.gaussian_noise(np.zeros(10_000, np.float32), std=2.0,
                                                     rng=np.random.default_rng(2)))) < 3.0


def test_sybil_clones_are_near_identical_and_seeded(honest) -> None:
    u = honest[0]
    clones = attacks.sybil_clones(u, k=5, jitter=0.05, rng=np.random.default_rng(3))
    again = attacks.sybil_clones(u, k=5, jitter=0.05, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(clones, again)
    assert clones.shape == (5, u.shape[0]) and clones.dtype == np.float32
    assert len({c.tobytes() for c in clones}) == 5  # distinct identities, not exact copies
    offsets = np.linalg.norm(clones - u, axis=1) / np.linalg.norm(u)
    assert np.all(offsets < 0.15)
    np.testing.assert_array_equal(attacks.sybil_clones(u, k=2, jitter=0.0,
                                                       rng=np.random.default_rng(0)), [u, u])


def test_alie_shifts_the_mean_by_z_standard_deviations(honest) -> None:
    z = attacks.alie_z(25, 5)  # s = floor(13.5) - 5 = 8, z = Phi^-1(17 / 25)
    assert z == pytest.approx(NormalDist().inv_cdf(17 / 25))
    v = attacks.alie(honest, num_clients=25, num_byzantine=5)
    np.testing.assert_allclose(v, honest.mean(0) - z * honest.std(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(attacks.alie(honest, num_clients=10, num_byzantine=2, z=1.5),
                               honest.mean(0) - 1.5 * honest.std(0), rtol=1e-5, atol=1e-6)


def test_alie_z_grows_with_the_number_of_attackers() -> None:
    zs = [attacks.alie_z(50, f) for f in (2, 5, 10, 20)]
    assert zs == sorted(zs) and zs[0] > 0
    with pytest.raises(ValueError):
        attacks.alie_z(10, 0)


def test_ipm_sends_minus_eps_times_the_honest_mean(honest) -> None:
    v = attacks.ipm(honest, eps=0.5)
    np.testing.assert_allclose(v, -0.5 * honest.mean(0), rtol=1e-5, atol=1e-7)
    assert float(v @ honest.mean(0)) < 0


def test_attacks_leave_their_inputs_untouched(honest) -> None:
    before = honest.copy()
    attacks.sign_flip(honest[0])
    attacks.scale_update(honest[0], factor=3.0)
    attacks.gaussian_noise(honest[0], std=1.0, rng=np.random.default_rng(0), additive=True)
    attacks.sybil_clones(honest[0], k=3, jitter=0.1, rng=np.random.default_rng(0))
    attacks.alie(honest, num_clients=10, num_byzantine=2)
    attacks.ipm(honest, eps=1.0)
    np.testing.assert_array_equal(honest, before)


def test_flip_labels_changes_only_the_source_class_and_copies() -> None:
    y = np.array([0, 1, 7, 1, 3], dtype=np.int32)
    out = attacks.flip_labels(y, 1, 7)
    np.testing.assert_array_equal(out, [0, 7, 7, 7, 3])
    np.testing.assert_array_equal(y, [0, 1, 7, 1, 3])
    assert out.dtype == y.dtype
    with pytest.raises(ValueError):
        attacks.flip_labels(np.array([0.5, 1.0]), 1, 7)


@pytest.mark.parametrize("call", [
    lambda u: attacks.sybil_clones(u, k=0, jitter=0.1, rng=np.random.default_rng(0)),
    lambda u: attacks.sybil_clones(u, k=2, jitter=-1.0, rng=np.random.default_rng(0)),
    lambda u: attacks.gaussian_noise(u, std=-1.0, rng=np.random.default_rng(0)),
    lambda u: attacks.sign_flip(np.stack([u, u])),
    lambda u: attacks.ipm(u, eps=1.0),
])
def test_bad_arguments_are_refused(call, honest) -> None:
    with pytest.raises(ValueError):
        call(honest[0])


def test_make_attack_noise_can_scale_with_the_update() -> None:
    from murmura.client.malicious import make_attack

    attack = make_attack("noise", {"std": "5", "relative": "1"}, seed=0)
    assert attack.update is not None and attack.data is None
    u = np.full(10_000, 0.01, np.float32)  # root mean square 0.01
    assert 0.045 < float(np.std(attack.update(u))) < 0.055
    absolute = make_attack("noise", {"std": "5"}, seed=0)
    assert absolute.update is not None
    assert 4.5 < float(np.std(absolute.update(u))) < 5.5
    with pytest.raises(ValueError, match="relative must be 0 or 1"):
        make_attack("noise", {"relative": "2"})


# ----------------------------------------------------------------------------- backdoors


def test_corner_trigger_is_the_bottom_right_square_of_a_square_image() -> None:
    np.testing.assert_array_equal(attacks.corner_trigger(64, size=2), [54, 55, 62, 63])
    np.testing.assert_array_equal(attacks.corner_trigger(9, size=1), [8])
    with pytest.raises(ValueError, match="square image"):
        attacks.corner_trigger(10)


def test_backdoor_data_stamps_and_relabels_exactly_the_chosen_fraction() -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 0.5, (40, 64)).astype(np.float32)
    y = np.arange(40) % 7  # labels 0..6, never the target 9
    trigger = attacks.corner_trigger(64)
    bx, by = attacks.backdoor_data(x, y, trigger=trigger, target=9, fraction=0.25,
                                   rng=np.random.default_rng(1))
    poisoned = by == 9
    assert poisoned.sum() == 10
    assert np.all(bx[poisoned][:, trigger] == 1.0)
    np.testing.assert_array_equal(bx[~poisoned], x[~poisoned])  # the clean rest is untouched
    np.testing.assert_array_equal(by[~poisoned], y[~poisoned])
    others = np.setdiff1d(np.arange(64), trigger)
    np.testing.assert_array_equal(bx[poisoned][:, others], x[poisoned][:, others])
    assert x.max() < 1.0  # inputs were not modified in place
    with pytest.raises(ValueError, match="fraction"):
        attacks.backdoor_data(x, y, trigger=trigger, target=9, fraction=0.0,
                              rng=np.random.default_rng(1))


def test_make_attack_backdoor_poisons_data_and_boosts_updates() -> None:
    from murmura.client.malicious import make_attack
    from murmura.tasks import ArrayDataset

    data = ArrayDataset(np.zeros((20, 64), np.float32), np.zeros(20, np.int64))
    attack = make_attack("backdoor", {"target": "7", "fraction": "0.5", "boost": "5"}, seed=3)
    assert attack.data is not None and attack.update is not None
    out = attack.data(data)
    assert int((out.y == 7).sum()) == 10 and float(out.x.sum()) == 10 * 4
    np.testing.assert_allclose(attack.update(np.ones(3, np.float32)), [5, 5, 5])
    assert make_attack("backdoor").update is None  # unboosted: the update goes as trained
    with pytest.raises(ValueError, match="fraction"):
        make_attack("backdoor", {"fraction": "1.5"})


# ----------------------------------------------------------------------------- Min-Max / Min-Sum


@pytest.mark.parametrize("perturbation", ["std", "unit", "sign"])
def test_min_max_stays_within_the_largest_honest_distance_and_moves_away(honest,
                                                                         perturbation) -> None:
    h = honest.astype(np.float64)
    v = attacks.min_max(honest, perturbation=perturbation).astype(np.float64)
    pair = ((h[:, None] - h[None]) ** 2).sum(-1)
    to_v = ((h - v) ** 2).sum(-1)
    assert to_v.max() <= pair.max() * (1 + 1e-6)
    assert to_v.max() >= 0.95 * pair.max()  # the search used up the room it had
    assert np.linalg.norm(v - h.mean(0)) > 0.1 * np.linalg.norm(h.std(0))


def test_min_sum_stays_within_the_largest_honest_sum_of_distances(honest) -> None:
    h = honest.astype(np.float64)
    v = attacks.min_sum(honest).astype(np.float64)
    bound = ((h[:, None] - h[None]) ** 2).sum(-1).sum(1).max()
    total = ((h - v) ** 2).sum()
    assert bound * 0.95 <= total <= bound * (1 + 1e-6)
    # Min-Sum is the stricter constraint: it moves no farther than Min-Max.
    mean = h.mean(0)
    assert np.linalg.norm(v - mean) <= np.linalg.norm(attacks.min_max(honest) - mean) + 1e-6
    with pytest.raises(ValueError, match="perturbation"):
        attacks.min_sum(honest, perturbation="up")


def test_square_trigger_places_a_patch_and_a_checkerboard_where_asked() -> None:
    idx, val = attacks.square_trigger(64, size=4, row=2, col=2, checker=True)
    assert sorted(idx.tolist()) == [r * 8 + c for r in range(2, 6) for c in range(2, 6)]
    img = np.zeros(64, np.float32)
    img[idx] = val
    block = img.reshape(8, 8)[2:6, 2:6]
    np.testing.assert_array_equal(block, (np.add.outer(range(2, 6), range(2, 6)) % 2 == 0))
    idx, val = attacks.square_trigger(64, size=2, row=6, col=6)
    np.testing.assert_array_equal(np.sort(idx), np.sort(attacks.corner_trigger(64, size=2)))
    np.testing.assert_array_equal(val, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        attacks.square_trigger(64, size=3, row=6, col=0)


def test_split_trigger_cuts_a_trigger_into_disjoint_parts_that_reassemble_it() -> None:
    idx, val = attacks.square_trigger(64, size=4, row=2, col=2, checker=True)
    parts = attacks.split_trigger(idx, val, 4)
    assert len(parts) == 4 and all(len(i) == 4 for i, _ in parts)
    np.testing.assert_array_equal(np.concatenate([i for i, _ in parts]), idx)
    np.testing.assert_array_equal(np.concatenate([v for _, v in parts]), val)
    with pytest.raises(ValueError, match="parts"):
        attacks.split_trigger(idx, val, 17)


def test_add_trigger_takes_one_value_per_index() -> None:
    x = np.full((2, 64), 0.5, np.float32)
    idx, val = attacks.square_trigger(64, size=2, row=3, col=3, checker=True)
    out = attacks.add_trigger(x, idx, value=val)
    np.testing.assert_array_equal(out[:, idx], np.tile(val, (2, 1)))
    assert np.all(np.delete(out, idx, axis=1) == 0.5) and np.all(x == 0.5)
    with pytest.raises(ValueError, match="values"):
        attacks.add_trigger(x, idx, value=[1.0, 0.0])


def test_rotate_labels_moves_every_class_by_the_shift() -> None:
    y = np.arange(10, dtype=np.int64)
    np.testing.assert_array_equal(attacks.rotate_labels(y), (y + 1) % 10)
    np.testing.assert_array_equal(attacks.rotate_labels(y, shift=3, classes=10), (y + 3) % 10)
    with pytest.raises(ValueError, match="moves no label"):
        attacks.rotate_labels(y, shift=10)
