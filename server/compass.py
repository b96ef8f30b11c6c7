"""FedCompass's computing-power-aware scheduler, as pure functions (no clock, no state).

FedCompass (Li, Chard, Foster, Kindratenko, Huerta and Ghosh, ICLR 2024,
https://arxiv.org/abs/2309.14675) gives every client a number of local steps ``Q`` in
``[q_min, q_max]`` from its measured speed, so that the clients of one *arrival group* finish
at about the same time; the server aggregates each group when it has arrived. Fast devices do
more local work instead of waiting, slow ones less, and updates are about as stale as the
number of groups in flight rather than the number of clients.

The policy that uses these functions (:class:`murmura.server.compass_policy.CompassPolicy`)
keeps the state: the groups, each client's speed estimate, and the buffered updates.
Everything here takes numbers and returns numbers, so the decisions are property-tested in
isolation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["COMPASS_STEPS", "Assignment", "GroupPlan", "StepBounds", "choose_group",
           "founder_steps", "new_group", "plan_batch", "refine_step_time", "steps_for",
           "version_step"]

#: The rules of :func:`version_step`: how far a version of m updates moves the model, in
#: weighted means of them (N its reference): sqrt(max(m/N, 1)), 1, or m/N.
COMPASS_STEPS = ("sqrt", "mean", "linear")


@dataclass(frozen=True)
class StepBounds:
    """The local steps a client may be given, and how late a group may arrive.

    ``latest_factor`` is the paper's lambda: a group created at ``t0`` that is expected at
    ``T`` is aggregated at the latest at ``T + (latest_factor - 1) * (T - t0)`` with whatever
    has arrived; the rest arrive late and enter the next aggregate.

    ``max_group`` (0: no limit) caps a group's members. With many clients of similar speed
    one group would otherwise take them all and the server would make one large step per
    group where a buffered server makes several; a full group makes the next client found
    (or join) another, so versions come at least every ``max_group`` updates.
    """

    q_min: int
    q_max: int
    latest_factor: float = 1.5
    max_group: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.q_min <= self.q_max:
            raise ValueError(f"local step bounds need 1 <= q_min <= q_max, got "
                             f"[{self.q_min}, {self.q_max}]")
        if not (math.isfinite(self.latest_factor) and self.latest_factor >= 1):
            raise ValueError(f"latest_factor must be a finite number >= 1, got "
                             f"{self.latest_factor}")
        if self.max_group < 0:
            raise ValueError(f"max_group must be >= 0 (0: no limit), got {self.max_group}")

    def full(self, members: int) -> bool:
        """Whether a group of ``members`` takes no one more."""
        return bool(self.max_group) and members >= self.max_group


@dataclass(frozen=True)
class GroupPlan:
    """An arrival group: when its members are expected and when it is aggregated at the
    latest."""

    gid: int
    arrival: float
    latest: float


@dataclass(frozen=True)
class Assignment:
    """One client's task: its group and its local steps."""

    gid: int
    steps: int


def steps_for(arrival: float, now: float, step_time: float, bounds: StepBounds) -> int | None:
    """Steps that finish by ``arrival`` when started ``now`` at ``step_time`` s per step, if
    that number lies within the bounds (None otherwise: the client does not fit the group).

    Rounding down means a client is never predicted to arrive after its group.
    """
    if not (step_time > 0 and math.isfinite(step_time)) or not now < arrival < math.inf:
        return None
    fit = (arrival - now) / step_time + 1e-9
    if not fit < bounds.q_max + 1:  # also inf and nan: a claimed speed can be absurd
        return None
    q = math.floor(fit)
    return q if q >= bounds.q_min else None


def choose_group(groups: Sequence[GroupPlan], now: float, step_time: float,
                 bounds: StepBounds, sizes: Mapping[int, int] | None = None
                 ) -> Assignment | None:
    """The existing group that gives the client the most local steps within the bounds (the
    earliest such group on a tie), or None when no group fits. ``sizes`` (group id ->
    members) excludes full groups (see :attr:`StepBounds.max_group`)."""
    best: Assignment | None = None
    for g in groups:
        if sizes is not None and bounds.full(sizes.get(g.gid, 0)):
            continue
        q = steps_for(g.arrival, now, step_time, bounds)
        if q is not None and (best is None or q > best.steps):
            best = Assignment(g.gid, q)
    return best


def founder_steps(now: float, step_time: float, bounds: StepBounds,
                  anchors: Iterable[tuple[float, float]] = ()) -> int:
    """Local steps for a client that fits no existing group and founds one.

    The paper's group creation (Li et al. 2024, Algorithm 2, "create group"): for each group
    still open (``now`` before its latest arrival time ``latest``), the time its fastest member
    (``fastest`` s per step) would be back from its *next* task of ``q_max`` steps is
    ``latest + fastest * q_max``; the founder gets the most steps, up to ``q_max``, that end
    by one of those times (raised to ``q_min`` if fewer). The new group then arrives when that
    group's fast members can join it after their own aggregate, so groups merge instead of
    multiplying, and a client waits for fewer other groups' versions while it trains. With no
    such group it gets ``q_max``.

    ``anchors`` holds ``(latest, fastest)`` per existing group.
    """
    if not (step_time > 0 and math.isfinite(step_time)):
        return bounds.q_max
    best = -1
    for latest, fastest in anchors:
        if not (now < latest < math.inf and fastest > 0 and math.isfinite(fastest)):
            continue
        fit = (latest + fastest * bounds.q_max - now) / step_time + 1e-9
        if fit < bounds.q_max + 1:  # also inf and nan
            best = max(best, math.floor(fit))
    if best < 0:
        return bounds.q_max
    return max(best, bounds.q_min)


def new_group(gid: int, now: float, step_time: float, bounds: StepBounds,
              steps: int | None = None) -> GroupPlan:
    """A group founded by a client of ``step_time`` s per step that trains ``steps`` steps
    (default ``q_max``; see :func:`founder_steps`): expected when those steps are done, and
    aggregated at the latest ``latest_factor`` times that span from now."""
    span = (bounds.q_max if steps is None else steps) * step_time
    return GroupPlan(gid, now + span, now + bounds.latest_factor * span)


def plan_batch(step_times: Mapping[str, float], now: float, groups: Sequence[GroupPlan],
               bounds: StepBounds, *, next_gid: int, sizes: Mapping[int, int] | None = None,
               fastest: Mapping[int, float] | None = None
               ) -> tuple[dict[str, Assignment], list[GroupPlan]]:
    """Assign several clients at once (the members of a group that was just aggregated).

    Clients are placed fastest first (ties by id), each into the existing or new group that
    gives it the most steps; a client that fits none founds a group with
    :func:`founder_steps` steps, aligned with the next arrival of an existing group's fastest
    member (``fastest``: group id -> its fastest member's seconds per step) or of a group
    founded earlier in this batch. Fastest first means a founder is the fastest member of its
    group, so slower clients join it with fewer steps rather than each founding a group of
    its own.

    ``sizes`` holds the existing groups' members; a full group takes no one.
    Returns the assignments and the groups created (ids from ``next_gid`` up).
    """
    plans = list(groups)
    created: list[GroupPlan] = []
    out: dict[str, Assignment] = {}
    counts = dict(sizes or {})
    quickest = dict(fastest or {})
    for cid in sorted(step_times, key=lambda c: (step_times[c], c)):
        t = step_times[cid]
        a = choose_group(plans, now, t, bounds, counts)
        if a is None:
            anchors = [(g.latest, quickest[g.gid]) for g in plans if g.gid in quickest]
            q = founder_steps(now, t, bounds, anchors)
            g = new_group(next_gid + len(created), now, t, bounds, q)
            created.append(g)
            plans.append(g)
            a = Assignment(g.gid, q)
        counts[a.gid] = counts.get(a.gid, 0) + 1
        quickest[a.gid] = min(quickest.get(a.gid, math.inf), t)
        out[cid] = a
    return out, created


def refine_step_time(previous: float | None, elapsed_s: float, steps: int, *,
                     weight: float = 0.5) -> float | None:
    """The speed estimate after a task of ``steps`` steps took ``elapsed_s`` (pull, train and
    push): the observation replaces a profile's figure and is averaged with earlier
    observations (exponentially, ``weight`` on the new one). Nonsense observations are
    ignored."""
    if steps <= 0 or not (elapsed_s > 0 and math.isfinite(elapsed_s)):
        return previous
    observed = elapsed_s / steps
    if previous is None:
        return observed
    return (1 - weight) * previous + weight * observed


def version_step(count: int, rule: str, reference: int) -> float:
    """How far a version of ``count`` updates moves the model, in weighted means of them.

    A FedCompass version averages a whole arrival group, which with many clients is several
    times a FedBuff buffer (57 updates against 10 in ``benchmarks/scheduling.py``); stepping
    by that mean makes a few small steps where FedBuff makes many. The rules:

    * ``"sqrt"``: ``sqrt(count / reference)``, at least 1. The mean of ``count`` updates has
      ``1 / sqrt(count)`` of one update's noise, so this step carries the noise of a mean of
      ``reference`` updates (a FedBuff version's, with ``reference`` its buffer size) while
      moving further as the group grows: the square-root rule for larger batches
      (Krizhevsky 2014, https://arxiv.org/abs/1404.5997; Hoffer, Hubara and Soudry 2017,
      https://arxiv.org/abs/1705.08741). A group smaller than ``reference`` moves by its
      mean, as a FedAvg round does.
    * ``"mean"``: 1, the group's weighted mean.
    * ``"linear"``: ``count / reference``, a fixed weight per update whatever the group's
      size. ``reference`` = the number of clients is the paper's weight 1/N (a group of
      everyone is a FedAvg round); ``reference`` = a FedBuff buffer gives each update
      FedBuff's weight.
    """
    if count < 1 or reference < 1:
        raise ValueError(f"version_step needs count >= 1 and reference >= 1, got {count} "
                         f"and {reference}")
    if rule == "mean":
        return 1.0
    if rule == "linear":
        return count / reference
    if rule == "sqrt":
        return math.sqrt(max(count / reference, 1.0))
    raise ValueError(f"unknown compass step rule {rule!r} (one of {', '.join(COMPASS_STEPS)})")
