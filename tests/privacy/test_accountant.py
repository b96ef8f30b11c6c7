"""The accountant (server/privacy.py) gives dp-accounting's own epsilon for the same schedule."""

from __future__ import annotations

import itertools
import logging
import math

import pytest

from murmura.server.privacy import Accountant, library_epsilon, with_release

dp_accounting = pytest.importorskip("dp_accounting", reason='pip install "murmura[privacy]"')
rdp = pytest.importorskip("dp_accounting.rdp")


def direct(schedule: list[tuple[float, float]], delta: float) -> float:
    """The library used as its documentation shows: a fresh RdpAccountant (default orders),
    each step's PoissonSampledDpEvent composed (equal consecutive steps with ``count``, which
    is the same sum of RDP curves and spares recomputing each), epsilon at ``delta``."""
    logging.getLogger("absl").setLevel(logging.ERROR)
    accountant = rdp.RdpAccountant()
    for (q, z), steps in itertools.groupby(schedule):
        accountant.compose(dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(z)), len(list(steps)))
    return float(accountant.get_epsilon(delta))


@pytest.mark.parametrize(("q", "z", "steps", "delta"), [
    (0.1, 1.0, 30, 1e-5), (0.01, 0.8, 2000, 1e-6), (1.0, 2.0, 5, 1e-5), (0.25, 4.0, 12, 1e-3)])
def test_our_epsilon_is_the_librarys_for_the_same_schedule(q: float, z: float, steps: int,
                                                           delta: float) -> None:
    expected = direct([(q, z)] * steps, delta)
    assert library_epsilon([(q, z, steps)], delta) == pytest.approx(expected, rel=1e-12)
    accountant = Accountant(delta)
    assert accountant.epsilon([(q, z, steps)]) == pytest.approx(expected, rel=1e-12)


def test_version_by_version_gives_the_librarys_epsilon_at_every_version() -> None:
    q, z, delta = 0.1, 1.0, 1e-5
    accountant, ledger = Accountant(delta), list[tuple[float, float, int]]()
    for step in range(1, 7):  # as a run grows its ledger: one compose per version
        ledger = with_release(ledger, q, z)
        assert accountant.epsilon(ledger) == pytest.approx(direct([(q, z)] * step, delta),
                                                           rel=1e-12)
    assert ledger == [(q, z, 6)]


def test_a_changing_sampling_rate_and_a_restart() -> None:
    schedule = [(0.5, 1.5)] * 2 + [(0.2, 1.5)] * 3 + [(0.25, 1.5)] * 2
    accountant, ledger = Accountant(1e-5), list[tuple[float, float, int]]()
    epsilons: list[float] = []
    for q, z in schedule:
        ledger = with_release(ledger, q, z)
        epsilons.append(accountant.epsilon(ledger))
    assert epsilons == sorted(epsilons) and len(ledger) == 3
    assert epsilons[-1] == pytest.approx(direct(schedule, 1e-5), rel=1e-12)
    fresh = Accountant(1e-5)  # a restarted server: the ledger comes back from the checkpoint
    assert fresh.epsilon(ledger) == pytest.approx(epsilons[-1], rel=1e-12)
    assert fresh.epsilon(ledger[:1]) == pytest.approx(epsilons[1], rel=1e-12)  # not a prefix


def test_no_noise_is_infinite_epsilon_and_no_release_is_zero() -> None:
    assert library_epsilon([(0.1, 0.0, 3)], 1e-5) == math.inf
    assert Accountant(1e-5).epsilon([(0.1, 0.0, 1)]) == math.inf
    assert Accountant(1e-5).epsilon([]) == 0.0


def test_unsampled_epsilon_is_the_q_equal_1_bound() -> None:
    accountant = Accountant(1e-5)
    ledger = [(0.05, 1.2, 40)]
    assert accountant.unsampled(ledger) == pytest.approx(direct([(1.0, 1.2)] * 40, 1e-5),
                                                         rel=1e-12)
    assert accountant.unsampled(ledger) > accountant.epsilon(ledger)


def test_delta_must_lie_in_the_open_unit_interval() -> None:
    for bad in (0.0, 1.0, -1e-5):
        with pytest.raises(ValueError, match="delta"):
            Accountant(bad)
