"""The server's SecAgg+ state machine and the client's, in memory through the real core.

These drive :class:`~murmura.server.secagg_policy.SecAggPolicy` with
:class:`~murmura.client.secagg.SecAggClient` objects through
:func:`murmura.simulation.secagg.play_round`, the same code the simulator runs; the gRPC
tests (tests/integration/test_secagg_grpc.py) run the same state machines over the wire.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from murmura.client.secagg import Peer, SecAggClient, SecAggRefused
from murmura.protocols import DeviceProfile, ModelSpec, TensorSpec
from murmura.protocols.identity import NodeKey
from murmura.protocols.secagg.envelope import EnvelopeError, SharePair, open_envelope, seal
from murmura.protocols.secagg.ring import FieldSpec
from murmura.protocols.secagg.weighted import SecAggParams, decode_weighted, encode_weighted
from murmura.server import AggregatorCore, ServerConfig
from murmura.server.secagg import Stage
from murmura.simulation.secagg import Member, _peers, advertise, play_round

SIZE = 40


def _core(n: int, **cfg: Any) -> tuple[AggregatorCore, dict[str, NodeKey]]:
    flat: dict[str, Any] = dict(min_clients=n, cohort_size=n, max_versions=3,
                                secure_aggregation=True, round_deadline_s=1e9)
    core = AggregatorCore(ServerConfig.from_flat(**{**flat, **cfg}),
                          ModelSpec((TensorSpec("w", (SIZE,)),)), np.zeros(SIZE, np.float32))
    keys = {}
    for _ in range(n):
        key = NodeKey.generate()
        nonce, _ = core.challenge()
        core.join(key.client_id, DeviceProfile(), proof=key.join_proof(nonce))
        keys[key.client_id] = key
    return core, keys


def _members(core: AggregatorCore, keys: dict[str, NodeKey], seed: int,
             drops: dict[int, str]) -> dict[str, Member]:
    rng = np.random.default_rng(seed)
    out = {}
    for cid in sorted(keys):  # every member takes its task: the round opens
        rec = core.record_of(cid)
        assert rec is not None and core.task(rec.session).action.name == "TRAIN"
    round_id = core.policy.round
    for i, cid in enumerate(sorted(keys)):
        rec = core.record_of(cid)
        assert rec is not None
        client = SecAggClient(cid, round_id, core.policy.params, identity=keys[cid],
                              require_identity=True)
        out[cid] = Member(rec, client, rng.normal(0, 0.05, SIZE).astype(np.float32),
                          float(rng.integers(100, 900)), drop_before=drops.get(i, ""))
    return out


def _fedavg(members: dict[str, Member], who: list[str]) -> np.ndarray:
    w = np.array([members[c].examples for c in who])
    u = np.stack([members[c].update for c in who]).astype(np.float64)
    return (w[:, None] * u).sum(0) / w.sum()


def test_the_published_version_is_fedavg_of_the_clients_whose_input_arrived() -> None:
    # Prepare: 12 clients; two drop before their masked input, two before unmasking
    core, keys = _core(12)
    members = _members(core, keys, 1, {0: "INPUT", 5: "INPUT", 3: "UNMASK", 9: "UNMASK"})
    # Execute
    stage = play_round(core.policy, members)
    # Assert
    assert stage == Stage.DONE and core.version == 1
    arrived = [c for i, c in enumerate(sorted(keys)) if i not in (0, 5)]
    expected = _fedavg(members, arrived)
    step = FieldSpec(bits=32, clip=1.0, n_max=12).step
    total = sum(members[c].examples for c in arrived) / 1000.0
    assert np.abs(core.params - expected).max() <= len(arrived) * step / total + 1e-8
    assert np.abs(expected).max() > 0.01


def test_too_many_dropouts_abandon_the_round_and_the_next_one_runs() -> None:
    # Prepare: 8 clients (complete graph, t = 4): four drop after their input, leaving every
    # included client with three answering neighbours
    core, keys = _core(8)
    members = _members(core, keys, 2, {1: "UNMASK", 2: "UNMASK", 4: "UNMASK", 6: "UNMASK"})
    # Execute
    stage = play_round(core.policy, members)
    # Assert: nothing published, nothing half-unmasked kept; the next round starts afresh
    assert stage == Stage.ABANDONED and core.version == 0
    assert "threshold" in core.policy.secagg.reason and core.policy.abandoned == 1
    assert core.policy.secagg._total is None
    again = _members(core, keys, 3, {})
    assert core.policy.round == 2
    assert play_round(core.policy, again) == Stage.DONE and core.version == 1
    assert np.allclose(core.params, _fedavg(again, sorted(keys)), atol=1e-6)


def test_masked_inputs_look_nothing_like_the_updates_and_cancel_in_the_sum() -> None:
    core, keys = _core(6)
    members = _members(core, keys, 4, {})
    seen: list[np.ndarray] = []
    real_fold = type(core.policy.secagg).fold_input

    def spy(self: Any, payload: bytes) -> None:
        seen.append(np.frombuffer(payload, "<u4").astype(np.uint64))
        real_fold(self, payload)

    type(core.policy.secagg).fold_input = spy  # type: ignore[method-assign]
    try:
        assert play_round(core.policy, members) == Stage.DONE
    finally:
        type(core.policy.secagg).fold_input = real_fold  # type: ignore[method-assign]
    params = core.policy.params
    plain = [encode_weighted(m.update, m.examples, params, n_max=6)
             for _, m in sorted(members.items())]
    assert len(seen) == 6
    for masked, x in zip(seen, plain, strict=True):
        assert np.mean(masked == x) < 0.01  # masked values are not the encodings
        assert masked.std() > 2**29       # but spread over the whole ring
    total = np.sum(seen, axis=0, dtype=np.uint64) & np.uint64(2**32 - 1)
    assert not np.array_equal(total, np.sum(plain, axis=0) & np.uint64(2**32 - 1))


@pytest.mark.parametrize(("flat", "words"), [
    ({"mode": "compass"}, "compass"),
    ({"defense": "median"}, "median"),
    ({"dp_clip": 0.5, "dp_clip_adaptive": 0.5}, "adaptive"),
    ({"accumulator": "exact"}, "accumulator"),
    ({"secagg_dropout": 0.6}, "secagg_dropout"),
    ({"secagg_bits": 4}, "bits"),
])
def test_incompatible_settings_are_refused_at_start_up(flat: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ServerConfig.from_flat(secure_aggregation=True, **flat)


def test_envelopes_open_only_for_their_pair_and_round() -> None:
    a, b = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    b_pub = b.public_key().public_bytes_raw()
    a_pub = a.public_key().public_bytes_raw()
    pair = SharePair(sender=1, receiver=2, t=3, self_y=12345, key_y=2**500)
    sealed = seal(a, b_pub, pair, round_id=7)
    assert open_envelope(b, a_pub, sealed, round_id=7, sender=1, receiver=2) == pair
    for kwargs in ({"round_id": 8, "sender": 1, "receiver": 2},
                   {"round_id": 7, "sender": 3, "receiver": 2}):
        with pytest.raises(EnvelopeError):
            open_envelope(b, a_pub, sealed, **kwargs)
    flipped = bytearray(sealed)
    flipped[20] ^= 1
    with pytest.raises(EnvelopeError):
        open_envelope(b, a_pub, bytes(flipped), round_id=7, sender=1, receiver=2)


def _peer(index: int, owner: NodeKey, signer: NodeKey, round_id: int = 1) -> Peer:
    c = SecAggClient(owner.client_id, round_id, SecAggParams(), identity=signer)
    mask_pk, enc_pk, commit, sig = c.keys()
    return Peer(index, owner.client_id, mask_pk, enc_pk, commit, signer.public_bytes, sig)


def test_a_client_refuses_keys_the_server_substituted() -> None:
    me = SecAggClient("me", 1, SecAggParams(), require_identity=True)
    honest, mallory = NodeKey.generate(), NodeKey.generate()
    good = [_peer(2, honest, honest), _peer(3, mallory, mallory)]
    assert len(me.share(1, 2, 3, good)) == 2
    other = SecAggClient("me", 1, SecAggParams(), require_identity=True)
    with pytest.raises(SecAggRefused, match="not signed"):  # honest's id, mallory's keys
        other.share(1, 2, 3, [_peer(2, honest, mallory), _peer(3, mallory, mallory)])


def test_a_client_refuses_to_unmask_a_client_both_ways() -> None:
    keys = [NodeKey.generate() for _ in range(3)]
    clients = [SecAggClient(k.client_id, 1, SecAggParams()) for k in keys]
    peers = []
    for i, (k, c) in enumerate(zip(keys, clients, strict=True)):
        mask_pk, enc_pk, commit, _ = c.keys()
        peers.append(Peer(i + 1, k.client_id, mask_pk, enc_pk, commit))
    sealed = {i: clients[i].share(i + 1, 2, 3, [p for p in peers if p.index != i + 1])
              for i in range(3)}
    for i in range(3):
        inbox = {j + 1: sealed[j][i + 1] for j in range(3) if j != i}
        clients[i].masked_input(inbox, np.zeros(4), 10)
    with pytest.raises(SecAggRefused, match="both"):
        clients[0].unmask([1, 2, 3], [2])
    with pytest.raises(SecAggRefused, match="leaves this client"):
        clients[0].unmask([2, 3], [])
    assert set(clients[0].unmask([1, 2, 3], [])) == {(2, "self"), (3, "self")}


def test_weighted_encoding_recovers_the_weighted_mean() -> None:
    params = SecAggParams(clip=0.5, max_weight=50)
    rng = np.random.default_rng(5)
    updates = rng.normal(0, 0.1, (4, 30))
    examples = [10, 25, 50, 80]  # the last is capped at max_weight
    total = sum(encode_weighted(u, e, params, n_max=4) for u, e in zip(updates, examples,
                                                                      strict=True))
    mean, weight = decode_weighted(total & np.uint64(2**32 - 1), count=4, params=params,
                                   n_max=4)
    w = np.minimum(examples, 50) / 50
    clipped = np.clip(updates, -0.5, 0.5)
    assert weight == pytest.approx(w.sum(), abs=1e-6)
    assert np.allclose(mean, (w[:, None] * clipped).sum(0) / w.sum(), atol=1e-6)


def test_a_simulated_secure_run_publishes_what_plain_fedavg_publishes(
        one_torch_thread: None) -> None:
    # Prepare: the same federation with and without secure aggregation
    from murmura.protocols import TaskSettings
    from murmura.simulation import SimulationConfig, simulate
    from murmura.tasks import TaskConfig

    task = TaskConfig(task="synthetic", model="logreg", partition="iid")
    train = TaskSettings(local_epochs=1, batch_size=10, lr=0.2, momentum=0.0)
    sim = SimulationConfig(clients=30, samples_per_client=20)

    def run(**flat: Any) -> Any:
        server = ServerConfig.from_flat(max_versions=3, cohort_size=10, round_deadline_s=1e9,
                                        train=train, **flat)
        return simulate(task, server, sim, out_dir=None)

    # Execute
    plain, secure = run(), run(secure_aggregation=True)
    # Assert: same versions, same model within the ring's quantisation, masked bytes counted
    assert secure.version == plain.version == 3
    assert np.abs(secure.params - plain.params).max() < 1e-5
    assert not np.array_equal(secure.params, plain.params)  # it did go through the ring
    assert secure.rows[-1]["secagg_clients"] == 10 and secure.rows[-1]["bytes_up"] > 0


def test_a_masked_input_outside_the_ring_is_refused_and_the_sum_kept() -> None:
    # Prepare: a 16-bit ring (4-byte words on the wire, so a word can exceed the ring)
    from murmura.protocols.secagg.weighted import to_wire
    from murmura.server.errors import InvalidArgument

    core, keys = _core(4, secagg_bits=16)
    members = _members(core, keys, 6, {})
    policy = core.policy
    for m in members.values():
        advertise(policy, m)
    assert policy.secagg.stage == Stage.SHARES
    for m in members.values():
        view = policy.view(m.record, 1)
        policy.share(m.record, 1, m.client.share(view.index, view.threshold, view.n_max,
                                                 _peers(view)))
    assert policy.secagg.stage == Stage.INPUT
    sa = policy.secagg
    first = next(iter(members.values()))
    view = policy.view(first.record, 1)
    good = first.client.masked_input(dict(view.ciphertexts), first.update, first.examples)
    bad = good.copy()
    bad[3] = 1 << 20  # not an element of Z_2^16
    # Execute
    with pytest.raises(InvalidArgument, match="outside the ring"):
        sa.fold_input(to_wire(bad, policy.params))
    sa.fold_input(to_wire(good, policy.params))
    # Assert: the refused vector left no trace in the sum
    assert np.array_equal(sa._total, good)


def test_async_groups_are_fedbuff_buffers_with_the_staleness_discount() -> None:
    # Prepare: FedBuff with buffers of 4; eight clients take tasks on version 0, forming
    # groups 1 and 2; group 1 is unmasked first, so group 2's updates are one version stale
    core, keys = _core(8, mode="async", buffer_size=4, staleness="polynomial",
                       staleness_exponent=0.5, max_staleness=5)
    policy = core.policy
    rng = np.random.default_rng(7)
    groups: dict[int, dict[str, Member]] = {1: {}, 2: {}}
    for cid in sorted(keys):
        rec = core.record_of(cid)
        assert rec is not None
        task = core.task(rec.session)
        assert task.action.name == "TRAIN" and task.version == 0
        client = SecAggClient(cid, task.round, policy.params, identity=keys[cid],
                              require_identity=True)
        groups[task.round][cid] = Member(rec, client, rng.normal(0, 0.05, SIZE)
                                         .astype(np.float32), float(rng.integers(100, 900)))
    assert core.task(core.record_of(sorted(keys)[0]).session).action.name == "WAIT"
    # Execute
    assert play_round(policy, groups[1]) == Stage.DONE
    after_first = core.params.copy()
    assert play_round(policy, groups[2]) == Stage.DONE
    # Assert: version 1 is group 1's FedAvg; version 2 adds group 2's, discounted by
    # (1 + 1) ** -0.5 for its staleness of one version
    assert core.version == 2
    step = FieldSpec(bits=32, clip=1.0, n_max=4).step
    tol = 4 * step / (sum(m.examples for m in groups[1].values()) / 1000) + 1e-7
    assert np.abs(after_first - _fedavg(groups[1], sorted(groups[1]))).max() <= tol
    factor = 2 ** -0.5
    second = core.params - after_first
    assert np.abs(second - factor * _fedavg(groups[2], sorted(groups[2]))).max() <= tol
    assert policy.secagg_round(2).factors == {cid: pytest.approx(factor) for cid in groups[2]}


def test_an_async_member_too_stale_leaves_its_group_as_a_dropout() -> None:
    core, keys = _core(9, mode="async", buffer_size=3, max_staleness=0)
    policy = core.policy
    rng = np.random.default_rng(8)
    groups: dict[int, dict[str, Member]] = {}
    for cid in sorted(keys):
        rec = core.record_of(cid)
        assert rec is not None
        task = core.task(rec.session)
        client = SecAggClient(cid, task.round, policy.params, identity=keys[cid])
        groups.setdefault(task.round, {})[cid] = Member(
            rec, client, rng.normal(0, 0.05, SIZE).astype(np.float32), 100.0)
    assert play_round(policy, groups[1]) == Stage.DONE and core.version == 1
    # group 2 trained on version 0: every member is now too stale; it cannot be unmasked
    assert play_round(policy, groups[2]) == Stage.ABANDONED and core.version == 1
    assert policy.abandoned == 1


def test_each_clients_noise_share_has_the_stated_std() -> None:
    # Prepare: z = 2, C = 0.5, a round unmasked with at least 4 inputs: std 2 * 0.5 / 2
    params = SecAggParams(clip=4.0, dp_clip=0.5, dp_noise_multiplier=2.0)
    rng = np.random.default_rng(11)
    size = 200_000
    # Execute: a zero update, so the ring holds the noise alone
    x = encode_weighted(np.zeros(size), 50, params, n_max=4, min_inputs=4, noise_rng=rng)
    noise, weight = decode_weighted(x, count=1, params=params, n_max=4)
    # Assert: std 0.5 within 1 % (the estimate's own error is ~0.16 %), mean ~0, weight 1
    assert weight == pytest.approx(1.0, abs=1e-6)
    assert noise.astype(np.float64).std() == pytest.approx(0.5, rel=0.01)
    assert abs(float(noise.mean())) < 0.005


def test_a_clients_update_is_clipped_to_the_dp_norm_before_masking() -> None:
    params = SecAggParams(clip=1.0, dp_clip=0.5)
    update = np.full(100, 0.2)  # norm 2: scaled by 1/4
    x = encode_weighted(update, 10, params, n_max=2, min_inputs=2)
    clipped, _ = decode_weighted(x, count=1, params=params, n_max=2)
    assert float(np.linalg.norm(clipped)) == pytest.approx(0.5, rel=1e-6)


@pytest.mark.skipif(__import__("importlib").util.find_spec("dp_accounting") is None,
                    reason="needs dp-accounting")
def test_distributed_dp_noises_the_sum_and_reports_the_librarys_epsilon() -> None:
    # Prepare: 20 clients, graph and noise planned for 10 % dropout: at least 18 inputs
    from murmura.server.privacy import library_epsilon

    size = 20_000
    flat: dict[str, Any] = dict(min_clients=20, cohort_size=20, max_versions=2,
                                secure_aggregation=True, round_deadline_s=1e9,
                                secagg_dropout=0.1, secagg_clip=4.0, dp_clip=0.5,
                                dp_noise_multiplier=1.5)
    core = AggregatorCore(ServerConfig.from_flat(**flat),
                          ModelSpec((TensorSpec("w", (size,)),)), np.zeros(size, np.float32))
    keys = {}
    for _ in range(20):
        key = NodeKey.generate()
        nonce, _ = core.challenge()
        core.join(key.client_id, DeviceProfile(), proof=key.join_proof(nonce))
        keys[key.client_id] = key
    for cid in sorted(keys):
        core.task(core.record_of(cid).session)
    rng = np.random.default_rng(12)
    members = {}
    for i, cid in enumerate(sorted(keys)):
        client = SecAggClient(cid, 1, core.policy.params, identity=keys[cid],
                              require_identity=True, rng=np.random.default_rng([12, i]))
        members[cid] = Member(core.record_of(cid), client,
                              rng.normal(0, 0.02, size).astype(np.float32), 50.0,
                              drop_before="INPUT" if i == 3 else "")
    # Execute
    assert play_round(core.policy, members) == Stage.DONE
    # Assert: the model is (sum of the clipped updates + the clients' noise) / 20, and the
    # noise on the sum has std sigma * sqrt(19) with sigma = z C / sqrt(18)
    arrived = [m for i, m in enumerate(members.values()) if i != 3]
    clipped = sum(u * min(1.0, 0.5 / float(np.linalg.norm(u))) for u in
                  (m.update.astype(np.float64) for m in arrived))
    residual = core.params.astype(np.float64) * 20 - clipped
    expected_std = 1.5 * 0.5 / np.sqrt(18) * np.sqrt(19)
    assert residual.std() == pytest.approx(expected_std, rel=0.03)
    row = core.last_metrics
    assert row["dp_noise_multiplier"] == 1.5 and row["dp_cohort"] == 20
    assert row["dp_epsilon"] == pytest.approx(library_epsilon([(1.0, 1.5, 1)], 1e-5),
                                              rel=1e-12)


def test_distributed_dp_abandons_a_round_whose_noise_would_fall_short() -> None:
    # 10 clients planned for 10 % dropout: at least 9 inputs; two drop, so the noise of the
    # eight shares that arrive would be below z C: nothing is unmasked, nothing published
    core, keys = _core(10, secagg_dropout=0.1, secagg_clip=4.0, dp_clip=0.5,
                       dp_noise_multiplier=1.0, require_identity=True)
    members = _members(core, keys, 13, {2: "INPUT", 7: "INPUT"})
    for i, m in enumerate(members.values()):
        m.client.rng = np.random.default_rng([13, i])
    assert play_round(core.policy, members) == Stage.ABANDONED and core.version == 0
    assert "at least 9" in core.policy.secagg.reason


@pytest.mark.skipif(__import__("importlib").util.find_spec("dp_accounting") is None,
                    reason="needs dp-accounting")
def test_async_groups_with_distributed_dp_share_one_ledger() -> None:
    # Prepare: FedBuff buffers of 4 as masked groups, distributed DP; two overlapping groups
    from murmura.server.privacy import library_epsilon

    core, keys = _core(8, mode="async", buffer_size=4, secagg_dropout=0.0, secagg_clip=4.0,
                       dp_clip=0.5, dp_noise_multiplier=1.2)
    policy = core.policy
    rng = np.random.default_rng(14)
    groups: dict[int, dict[str, Member]] = {1: {}, 2: {}}
    for i, cid in enumerate(sorted(keys)):
        rec = core.record_of(cid)
        task = core.task(rec.session)
        client = SecAggClient(cid, task.round, policy.params, identity=keys[cid],
                              require_identity=True, rng=np.random.default_rng([14, i]))
        groups[task.round][cid] = Member(rec, client, rng.normal(0, 0.05, SIZE)
                                         .astype(np.float32), 30.0)
    # Execute
    assert play_round(policy, groups[1]) == Stage.DONE
    assert play_round(policy, groups[2]) == Stage.DONE
    # Assert: the second version's epsilon composes both releases (q = 4 / 8)
    assert core.version == 2
    assert core.last_metrics["dp_epsilon"] == pytest.approx(
        library_epsilon([(0.5, 1.2, 2)], 1e-5), rel=1e-12)
