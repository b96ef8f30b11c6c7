"""Client-level differential privacy on the server: the DP stage and its accountant.

The stage wraps the run's decomposable rule in :class:`~murmura.aggregation.dp.DPMean`
(clip each decoded update, uniform weights, Gaussian noise on the sum once per version; see
aggregation/dp.py), plans each version's denominator and sampling rate, refuses to publish a
version whose epsilon would pass ``--dp-target-epsilon``, and adds the ``dp_*`` figures to the
metrics rows and summary.json. Epsilon comes from Google's ``dp-accounting`` library (its RDP
accountant composing one Poisson-subsampled Gaussian event per version), never from a formula
of ours. docs/privacy.md says what this protects and what it assumes.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from murmura.aggregation import Aggregator
from murmura.aggregation.dp import AdaptiveClip, DPMean

if TYPE_CHECKING:
    from murmura.server.config import PrivacyConfig, ServerConfig
    from murmura.server.outputs import RunRecorder

log = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "murmura[privacy]"'
#: What summary.json says computed epsilon.
ACCOUNTANT = ("dp-accounting RdpAccountant: one PoissonSampledDpEvent(q, GaussianDpEvent(z)) "
              "per version, add-or-remove-one client")

Ledger = Sequence[tuple[float, float, int]]


class PrivacyBudgetSpent(ValueError):
    """Publishing the next version would take epsilon past ``--dp-target-epsilon``."""


def require_accounting(flag: str = "--dp-clip") -> None:
    """Raise ValueError, one line, when dp-accounting is not installed."""
    if importlib.util.find_spec("dp_accounting") is None:
        raise ValueError(f"{flag}: differential privacy needs its accountant, dp-accounting, "
                         f"which is not installed: {INSTALL_HINT}")


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    """dp-accounting logs a warning through absl for every fractional RDP order whose series
    does not converge (it then leaves that order out, as it should); keep those out of a
    run's log."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _event(q: float, z: float) -> Any:
    import dp_accounting

    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))


def library_epsilon(ledger: Ledger, delta: float) -> float:
    """Epsilon at ``delta`` of the releases in ``ledger`` (``(q, z, count)`` runs), from a
    fresh ``dp_accounting.rdp.RdpAccountant`` with its default orders; inf when any release
    had no noise. What :class:`Accountant` gives, computed in one go (tests compare them)."""
    from dp_accounting import rdp

    if any(z == 0 for _, z, _ in ledger):
        return math.inf
    accountant = rdp.RdpAccountant()
    with _quiet_absl():
        for q, z, count in ledger:
            accountant.compose(_event(q, z), int(count))
        return float(accountant.get_epsilon(delta))


class Accountant:
    """Epsilon of a growing ledger, composing only what is new since the last call.

    An RDP accountant's state is a sum over events, so the ledger ``L + [release]`` costs one
    ``compose`` on a copy of ``L``'s accountant (~0.05-0.2 s on one core), not a replay of
    the whole run. A ledger that is not an extension of the last one (a restart) is composed
    from scratch.
    """

    def __init__(self, delta: float) -> None:
        if not 0 < delta < 1:
            raise ValueError(f"delta must lie in (0, 1), got {delta}")
        self.delta = delta
        self._runs: list[tuple[float, float, int]] = []
        self._acc: Any = None
        self._eps = 0.0

    def epsilon(self, ledger: Ledger) -> float:
        runs = [(float(q), float(z), int(c)) for q, z, c in ledger]
        if runs == self._runs and self._acc is not None:
            return self._eps
        if any(z == 0 for _, z, _ in runs):
            self._runs, self._acc, self._eps = runs, None, math.inf
            return math.inf
        from dp_accounting import rdp

        todo = _extension(self._runs, runs) if self._acc is not None else None
        acc = copy.deepcopy(self._acc) if todo is not None else rdp.RdpAccountant()
        with _quiet_absl():
            for q, z, count in (todo if todo is not None else runs):
                acc.compose(_event(q, z), count)
            eps = float(acc.get_epsilon(self.delta)) if runs else 0.0
        self._runs, self._acc, self._eps = runs, acc, eps
        return eps

    def unsampled(self, ledger: Ledger) -> float:
        """Epsilon with every sampling rate taken as 1 (no amplification by sampling): the
        bound that holds however the clients in each version were chosen."""
        return library_epsilon([(1.0, z, c) for _, z, c in ledger], self.delta)


def _extension(old: list[tuple[float, float, int]], new: list[tuple[float, float, int]]
               ) -> list[tuple[float, float, int]] | None:
    """The runs ``new`` adds to ``old`` when it extends it (same releases first), else None."""
    if not old:
        return new
    if len(new) < len(old) or new[:len(old) - 1] != old[:-1]:
        return None
    q, z, count = old[-1]
    nq, nz, ncount = new[len(old) - 1]
    if (nq, nz) != (q, z) or ncount < count:
        return None
    extra = [(q, z, ncount - count)] if ncount > count else []
    return extra + new[len(old):]


def with_release(ledger: Ledger, q: float, z: float) -> list[tuple[float, float, int]]:
    """``ledger`` plus one release at ``(q, z)``, in the ledger's run-length form."""
    runs = [(float(a), float(b), int(c)) for a, b, c in ledger]
    if runs and runs[-1][:2] == (q, z):
        runs[-1] = (q, z, runs[-1][2] + 1)
    else:
        runs.append((q, z, 1))
    return runs


class PrivacyStage:
    """The server's DP stage: wraps the rule, plans, checks the budget, reports.

    ``plan`` runs on the owner's thread when a version is handed to the publisher (it reads
    the cohort and the clients); ``admit`` and ``released`` run on the publisher thread, before
    and after the aggregate is taken; ``stopped`` on the owner's thread when the budget ends
    the run.
    """

    def __init__(self, config: ServerConfig, *, seed: int) -> None:
        require_accounting()
        self.config: PrivacyConfig = config.privacy
        self.mode = config.mode
        self.buffer_size = config.policy.buffer_size
        self.seed = seed
        self.accountant = Accountant(self.config.dp_delta)
        self.epsilon = 0.0
        self.stop_reason = ""
        self._warned_delta = False
        cfg = self.config
        self.adaptive = (AdaptiveClip(cfg.dp_clip_adaptive, cfg.dp_clip_lr,
                                      cfg.dp_clip_count_noise)
                         if cfg.dp_clip_adaptive > 0 else None)
        self._recorder: RunRecorder | None = None
        if cfg.dp_noise_multiplier == 0:
            log.warning("differential privacy: --dp-clip without --dp-noise-multiplier only "
                        "clips updates; epsilon is infinite")

    @classmethod
    def for_run(cls, config: ServerConfig, *, has_buffers: bool, seed: int,
                recorder: RunRecorder | None = None) -> PrivacyStage | None:
        """The stage when the config turns DP on (``--dp-clip``), else None; it notes its
        figures for summary.json in ``recorder``."""
        if not config.privacy.enabled:
            return None
        if has_buffers:
            raise ValueError("differential privacy needs a model without buffers (BatchNorm "
                             "running statistics are averaged outside the clipped, noised "
                             "sum); use GroupNorm or LayerNorm")
        stage = cls(config, seed=seed)
        stage.attach(recorder)
        return stage

    def attach(self, recorder: RunRecorder | None) -> None:
        """Where summary.json's ``privacy`` entry goes (the run's recorder, if any)."""
        self._recorder = recorder
        self._note()

    # -- the rule ---------------------------------------------------------------------------

    def wrap(self, inner: Aggregator) -> DPMean:
        cfg = self.config
        expected = self.buffer_size if self.mode == "async" else 1
        return DPMean(inner, clip=cfg.dp_clip, noise_multiplier=cfg.dp_noise_multiplier,
                      seed=self.seed, adaptive=self.adaptive, expected=expected)

    @staticmethod
    def _dp(aggregator: Aggregator) -> DPMean:
        if not isinstance(aggregator, DPMean):
            raise TypeError(f"the DP stage needs the DPMean rule, got {type(aggregator)}")
        return aggregator

    # -- per version ------------------------------------------------------------------------

    def plan(self, cohort: int, population: int) -> dict[str, Any]:
        """A version's denominator ``m`` and sampling rate ``q = m / population``, for its
        metrics row (owner's thread). ``cohort``: the sync round's cohort size (async: the
        buffer size is used). Both are fixed before any update of the version is seen."""
        m = max(self.buffer_size if self.mode == "async" else cohort, 1)
        population = max(population, m)
        if not self._warned_delta and self.config.dp_delta >= 1.0 / population:
            self._warned_delta = True
            log.warning("differential privacy: --dp-delta %g is not below 1 / clients (%d); "
                        "such a delta allows leaking one client's data outright",
                        self.config.dp_delta, population)
        return {"dp_cohort": m, "dp_sampling_rate": m / population}

    def admit(self, aggregator: Aggregator, row: dict[str, Any], version: int) -> None:
        """Before the aggregate (publisher thread): set its plan, and refuse with
        :class:`PrivacyBudgetSpent` when releasing it would pass the target epsilon."""
        dp = self._dp(aggregator)
        dp.expect(int(row["dp_cohort"]), float(row["dp_sampling_rate"]))
        self.epsilon = self.accountant.epsilon(dp.ledger)  # cached since the last version
        target = self.config.dp_target_epsilon
        if not target:
            return
        after = self.accountant.epsilon(with_release(dp.ledger, dp.sampling_rate,
                                                     dp.noise_multiplier))
        if after > target:
            dp.reset()  # its updates are never released (nothing was taken: no ledger entry)
            raise PrivacyBudgetSpent(
                f"differential privacy budget reached: version {version} would bring epsilon "
                f"to {after:.3g} > --dp-target-epsilon {target:g} (delta "
                f"{self.config.dp_delta:g}); the run stops at version {version - 1}, epsilon "
                f"{self.epsilon:.3g}")

    def released(self, aggregator: Aggregator) -> dict[str, Any]:
        """The metrics row's ``dp_*`` figures once the aggregate was taken (publisher)."""
        dp = self._dp(aggregator)
        last = dp.last
        assert last is not None, "released() before any aggregate"
        self.epsilon = self.accountant.epsilon(dp.ledger)
        row: dict[str, Any] = {
            "dp_epsilon": self.epsilon, "dp_delta": self.config.dp_delta,
            "dp_epsilon_unsampled": self.accountant.unsampled(dp.ledger),
            "dp_clip": last.clip, "dp_noise_multiplier": last.noise_multiplier,
            "dp_noise_std": last.noise_std,
        }
        if last.delta_multiplier != last.noise_multiplier:
            row["dp_delta_noise_multiplier"] = last.delta_multiplier
        if last.below_clip is not None:
            row["dp_below_clip"] = last.below_clip
        if last.skipped:
            row["dp_skipped"] = last.skipped
        self._note(row)
        return row

    def stopped(self, exc: PrivacyBudgetSpent) -> None:
        """The budget ended the run (owner's thread): one log line and summary.json."""
        self.stop_reason = str(exc)
        log.warning("%s", exc)
        self._note()

    def _note(self, row: dict[str, Any] | None = None) -> None:
        if self._recorder is None:
            return
        cfg = self.config
        entry = dict(self._recorder.notes.get("privacy", {}))
        entry.update({"delta": cfg.dp_delta, "noise_multiplier": cfg.dp_noise_multiplier,
                      "clip": cfg.dp_clip, "clip_adaptive": cfg.dp_clip_adaptive or None,
                      "target_epsilon": cfg.dp_target_epsilon or None,
                      "accountant": ACCOUNTANT, "stopped": self.stop_reason or None})
        entry.setdefault("epsilon", 0.0)
        if row is not None:
            entry.update({"epsilon": row["dp_epsilon"],
                          "epsilon_unsampled": row["dp_epsilon_unsampled"],
                          "last_clip": row["dp_clip"]})
        self._recorder.notes["privacy"] = entry
        self._recorder.notes["dp_epsilon"] = entry["epsilon"]


__all__ = ["ACCOUNTANT", "INSTALL_HINT", "Accountant", "PrivacyBudgetSpent", "PrivacyStage",
           "library_epsilon", "require_accounting", "with_release"]
