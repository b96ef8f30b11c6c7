"""Secure aggregation in memory: the real client and server state machines, no network.

:func:`play_round` hands each member's messages from its
:class:`~murmura.client.secagg.SecAggClient` to the server's
:class:`~murmura.server.secagg_policy.SecAggPolicy` and the server's answers back, as the gRPC
servicer and :func:`~murmura.client.secagg.run_round` do over the wire, so a simulated round
refuses, drops and unmasks exactly as a deployed one. What the simulation leaves out is time:
a client that drops out is taken for gone at once instead of at the step's deadline.

:class:`SecAggDriver` connects it to the discrete-event engine: a client's masked push
arrives as its key advert, and once the whole cohort's adverts are in, the remaining steps are
played among the members still online.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from murmura.client.secagg import Peer, SecAggClient
from murmura.protocols import FlatVector, UpdateHeader
from murmura.protocols.secagg.weighted import to_wire
from murmura.server.secagg import AdvertisedKeys, ClientView, Stage
from murmura.server.secagg_policy import SecAggAsyncPolicy, SecAggPolicy
from murmura.server.sessions import ClientRecord

Policy: TypeAlias = SecAggPolicy | SecAggAsyncPolicy

#: The stages a member may drop out before (it never takes that step).
DROP_POINTS = ("KEYS", "SHARES", "INPUT", "UNMASK")


@dataclass
class Member:
    """One client of the round: its record on the server, its secrets, its update."""

    record: ClientRecord
    client: SecAggClient
    update: FlatVector
    examples: float
    #: The stage before which it drops out ("" : it stays).
    drop_before: str = ""
    #: Bytes it sent (the messages' payloads; the benchmark reads them).
    bytes_up: int = 0
    advertised: bool = field(default=False)


def _peers(view: ClientView) -> list[Peer]:
    return [Peer(index=p.index, client_id=p.client_id, mask_public_key=p.keys.mask_public_key,
                 enc_public_key=p.keys.enc_public_key, self_commitment=p.keys.self_commitment,
                 identity_key=p.keys.identity_key, signature=p.keys.signature)
            for p in view.neighbours]


def advertise(policy: Policy, m: Member) -> None:
    """The member's KEYS step (its masked push arriving, in the engine)."""
    mask_pk, enc_pk, commitment, signature = m.client.keys()
    policy.advertise(m.record, m.client.round_id,
                     AdvertisedKeys(mask_pk, enc_pk, commitment, signature=signature))
    sent = len(mask_pk) + len(enc_pk) + len(commitment) + len(signature)
    m.bytes_up += sent
    traffic = getattr(policy.core, "traffic", None)
    if traffic is not None:
        traffic.bytes_up += sent
    m.advertised = True


def play_round(policy: Policy, members: Mapping[str, Member], *,
               online: Callable[[str], bool] = lambda cid: True) -> Stage:
    """Play the remaining steps of the members' round (sync) or group (async) until it is
    DONE or ABANDONED (or waits for someone outside ``members``). A member whose
    ``drop_before`` names a step, or who is not ``online``, leaves the round there."""
    round_id = next(iter(members.values())).client.round_id
    for stage_name in DROP_POINTS:
        sa = policy.secagg_round(round_id)
        if sa is None or sa.finished:
            break
        for cid, m in sorted(members.items()):
            if sa.finished or sa.stage.name != stage_name:
                break
            if m.drop_before == stage_name or not online(cid):
                if cid not in sa.gone:
                    policy.on_leave(m.record)  # as a Leave, or the step's deadline, would
                continue
            if cid in sa.gone:
                continue
            _step(policy, stage_name, m)
        if not sa.finished and sa.stage.name == stage_name:
            policy._progress(sa)  # everyone left at this stage is gone: close it
    sa = policy.secagg_round(round_id)
    return sa.stage if sa is not None else Stage.ABANDONED


def _step(policy: Policy, stage: str, m: Member) -> None:
    if stage == "KEYS":
        if not m.advertised:
            advertise(policy, m)  # counts its own bytes
        return
    before = m.bytes_up
    try:
        _take_step(policy, stage, m)
    finally:
        traffic = getattr(policy.core, "traffic", None)
        if traffic is not None:  # the server's bytes_up counts the protocol's messages
            traffic.bytes_up += m.bytes_up - before


def _take_step(policy: Policy, stage: str, m: Member) -> None:
    rec, c = m.record, m.client
    view = policy.view(rec, c.round_id)
    if stage == "SHARES":
        envelopes = c.share(view.index, view.threshold, view.n_max, _peers(view))
        m.bytes_up += sum(len(v) + 4 for v in envelopes.values())
        policy.share(rec, c.round_id, envelopes)
    elif stage == "INPUT":
        masked = c.masked_input(dict(view.ciphertexts), m.update, m.examples,
                                factor=view.factor, min_inputs=view.min_inputs)
        payload = to_wire(masked, c.params)
        header = UpdateHeader(session=rec.session, update_id=f"secagg-{c.round_id}",
                              base_version=0, num_examples=0, round=c.round_id,
                              codec=c.params.codec,
                              payload_bytes=len(payload))
        sa, index = policy.begin_input(rec, header)
        publisher = policy.core.publisher  # type: ignore[attr-defined]
        ok = False
        try:
            publisher.submit(lambda: sa.fold_input(payload)).result()
            ok = True
        finally:
            policy.end_input(sa, index, ok)
        m.bytes_up += len(payload)
    elif stage == "UNMASK":
        shares = c.unmask(list(view.included), list(view.dropped))
        m.bytes_up += 70 * len(shares)
        policy.respond(rec, c.round_id, shares)


class SecAggDriver:
    """The engine's side: collects each member's update as its key advert, then plays its
    round's (or async group's) other steps among the members still online once the keys
    stage has closed."""

    def __init__(self, policy: Policy, *, seed: int) -> None:
        self.policy = policy
        self.seed = seed
        #: round (group) -> its members that have advertised
        self.members: dict[int, dict[str, Member]] = {}

    def take(self, record: ClientRecord, round_id: int, update: FlatVector,
             examples: float) -> None:
        """A member's trained update arrives (raises the policy's ServiceError to refuse)."""
        group = self.members.get(round_id, {})
        rng = np.random.default_rng([self.seed, round_id, len(group)])
        client = SecAggClient(record.client_id, round_id, self.policy.params, rng=rng)
        m = Member(record, client, update, examples)
        advertise(self.policy, m)  # a refusal leaves no trace here
        group[record.client_id] = m
        self.members[round_id] = group

    def pump(self, online: Callable[[str], bool]) -> None:
        """Play on every round whose keys stage has closed; forget finished ones."""
        for round_id in sorted(self.members):
            sa = self.policy.secagg_round(round_id)
            if sa is not None and not sa.finished and sa.stage != Stage.KEYS:
                play_round(self.policy, self.members[round_id], online=online)
            if sa is None or sa.finished:
                del self.members[round_id]


__all__ = ["DROP_POINTS", "Member", "SecAggDriver", "advertise", "play_round"]
