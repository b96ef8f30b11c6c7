"""Node identities on the core: challenge-response joins, signed updates, allow-lists.

The core is driven directly (no transport) so every refusal is checked with its exact type and
the state it must leave unchanged; tests/security/test_tls.py repeats the key cases over gRPC.
"""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from murmura.protocols import DeviceProfile, ModelSpec, TensorSpec, UpdateHeader
from murmura.protocols.identity import (
    IdentityError,
    NodeKey,
    client_id_for,
    join_message,
    load_public_keys,
    payload_digest,
    signed_update_message,
)
from murmura.server import AggregatorCore, ServerConfig
from murmura.server.errors import (
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)

SPEC = ModelSpec((TensorSpec("w", (4,)),))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_core(clock: Clock | None = None, **cfg) -> AggregatorCore:
    cfg.setdefault("min_clients", 2)
    return AggregatorCore(ServerConfig.from_flat(**cfg), SPEC, np.zeros(4, np.float32),
                          clock=clock or Clock())


def join(core: AggregatorCore, key: NodeKey) -> str:
    nonce, _ = core.challenge()
    return core.join(key.client_id, DeviceProfile(), proof=key.join_proof(nonce)).session


def signed(core: AggregatorCore, session: str, key: NodeKey, values, *, uid: str = "u1",
           n: int = 10) -> tuple[UpdateHeader, bytes]:
    payload = np.asarray(values, "<f4").tobytes()
    header = UpdateHeader(session=session, update_id=uid, base_version=core.version,
                          round=getattr(core.policy, "round", 0), num_examples=n,
                          codec="dense-f32", payload_bytes=len(payload),
                          spec_fingerprint=core.fingerprint)
    return key.sign_update(header, payload_digest(payload)), payload


def test_client_id_derives_from_the_key_and_is_short_printable_and_stable() -> None:
    a, b = NodeKey.generate(), NodeKey.generate()
    assert a.client_id == client_id_for(a.public_bytes) == a.client_id
    assert a.client_id != b.client_id
    assert a.client_id.startswith("n-") and len(a.client_id) == 28
    assert a.client_id.isprintable() and a.client_id.isascii()
    with pytest.raises(IdentityError, match="32 bytes"):
        client_id_for(b"short")


def test_signed_messages_are_domain_separated_and_unambiguous() -> None:
    # every header field in turn: tests/security/test_update_signature.py
    nonce, pk = b"n" * 32, b"k" * 32
    header = UpdateHeader(session="s", update_id="u", base_version=1, round=2, num_examples=3,
                          codec="dense-f32", payload_bytes=4, metrics={"loss": 0.5},
                          spec_fingerprint="f")
    base = signed_update_message(header, b"h" * 32)
    assert signed_update_message(header, b"x" * 32) != base
    # field boundaries count: ("ab", "c") and ("a", "bc") must not encode alike
    assert signed_update_message(UpdateHeader(**{**header.__dict__, "session": "ab",
                                                 "update_id": "c"}), b"h" * 32) != \
        signed_update_message(UpdateHeader(**{**header.__dict__, "session": "a",
                                              "update_id": "bc"}), b"h" * 32)
    assert join_message(nonce, "id", pk) != join_message(nonce, "id2", pk)
    assert not base.startswith(join_message(nonce, "id", pk)[:17])


def test_key_files_round_trip_with_private_mode_and_clear_errors(tmp_path) -> None:
    key = NodeKey.generate()
    pub = key.save(tmp_path / "node.key")
    assert stat.S_IMODE(os.stat(tmp_path / "node.key").st_mode) == 0o600
    assert NodeKey.load(tmp_path / "node.key").client_id == key.client_id
    assert load_public_keys(pub) == {key.public_bytes}
    with pytest.raises(IdentityError, match="already exists"):
        key.save(tmp_path / "node.key")
    with pytest.raises(IdentityError, match="cannot read key file"):
        NodeKey.load(tmp_path / "missing.key")
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(IdentityError, match="not an unencrypted PEM"):
        NodeKey.load(tmp_path / "junk.key")
    (tmp_path / "bad.list").write_text("# comment\n\nzz-not-hex\n")
    with pytest.raises(IdentityError, match="bad.list:3"):
        load_public_keys(tmp_path / "bad.list")


def test_join_requires_a_proof_over_a_single_use_unexpired_challenge() -> None:
    clock = Clock()
    core = make_core(clock)
    key = NodeKey.generate()
    with pytest.raises(Unauthenticated, match="requires a node identity"):
        core.join(key.client_id, DeviceProfile())
    nonce, ttl = core.challenge()
    proof = key.join_proof(nonce)
    assert core.join(key.client_id, DeviceProfile(), proof=proof).session
    with pytest.raises(Unauthenticated, match="unknown, used or expired"):
        core.join(key.client_id, DeviceProfile(), proof=proof)  # a replayed Join
    nonce, _ = core.challenge()
    clock.t += ttl + 1
    with pytest.raises(Unauthenticated, match="unknown, used or expired"):
        core.join(key.client_id, DeviceProfile(), proof=key.join_proof(nonce))
    nonce, _ = core.challenge()
    bad = key.join_proof(nonce)
    forged = type(bad)(bad.public_key, bad.nonce, bytes(64))
    with pytest.raises(Unauthenticated, match="does not verify"):
        core.join(key.client_id, DeviceProfile(), proof=forged)
    assert core.traffic.refused == {"UNAUTHENTICATED": 4}  # every refused join is counted
    assert len(core.sessions) == 1


def test_an_impostor_cannot_take_over_a_client_id() -> None:
    core = make_core()
    real, impostor = NodeKey.generate(), NodeKey.generate()
    session = join(core, real)
    nonce, _ = core.challenge()
    with pytest.raises(PermissionDenied, match="not the id of this public key"):
        core.join(real.client_id, DeviceProfile(), proof=impostor.join_proof(nonce))
    # an unsigned Join for the id is refused too, even where identities are optional
    lax = make_core(require_identity=False)
    held = join(lax, real)
    with pytest.raises(PermissionDenied, match="held by another key"):
        lax.join(real.client_id, DeviceProfile())
    assert lax.sessions[held].public_key == real.public_bytes
    # the real client's session carries on and its update counts
    assert core.sessions[session].client_id == real.client_id
    header, payload = signed(core, session, real, [1, 1, 1, 1])
    core.task(session)
    assert core.push(header, payload).duplicate is False
    # the real client restarting (same key) takes its own identity over
    again = join(core, real)
    assert again != session and session not in core.sessions


def test_update_ids_of_different_identities_never_collide() -> None:
    core = make_core()
    a, b = NodeKey.generate(), NodeKey.generate()
    sa, sb = join(core, a), join(core, b)
    core.task(sa), core.task(sb)
    ha, pa = signed(core, sa, a, [1, 1, 1, 1], uid="same")
    hb, pb = signed(core, sb, b, [3, 3, 3, 3], uid="same")
    assert core.push(hb, pb).duplicate is False  # the impostor's id is its own
    assert core.push(ha, pa).duplicate is False
    assert core.version == 1
    np.testing.assert_allclose(core.params, [2, 2, 2, 2])


def test_unsigned_forged_or_modified_updates_are_refused_and_change_nothing() -> None:
    core = make_core(min_clients=1)
    key, other = NodeKey.generate(), NodeKey.generate()
    session = join(core, key)
    core.task(session)
    header, payload = signed(core, session, key, [1, 1, 1, 1])
    unsigned = UpdateHeader(**{**header.__dict__, "signature": b""})
    with pytest.raises(PermissionDenied, match="only signed updates"):
        core.push(unsigned, payload)
    with pytest.raises(InvalidArgument, match="64 bytes"):
        core.push(UpdateHeader(**{**header.__dict__, "signature": b"x" * 10}), payload)
    tampered = np.asarray([9, 9, 9, 9], "<f4").tobytes()
    with pytest.raises(PermissionDenied, match="does not verify"):
        core.push(header, tampered)
    more = UpdateHeader(**{**header.__dict__, "num_examples": 1000})
    with pytest.raises(PermissionDenied, match="does not verify"):
        core.push(more, payload)
    by_other = other.sign_update(header, payload_digest(payload))
    with pytest.raises(PermissionDenied, match="does not verify"):
        core.push(by_other, payload)
    assert core.version == 0 and core.traffic.updates == 0
    np.testing.assert_array_equal(core.params, np.zeros(4))
    assert core.traffic.refused == {"PERMISSION_DENIED": 4, "INVALID_ARGUMENT": 1}
    # the genuine update still counts afterwards (a refused attempt did not burn its id)
    assert core.push(header, payload).duplicate is False
    assert core.version == 1


def test_an_update_replayed_in_another_session_is_refused() -> None:
    core = make_core(mode="async", buffer_size=1, min_clients=1, max_versions=5)
    key = NodeKey.generate()
    first = join(core, key)
    header, payload = signed(core, first, key, [1, 1, 1, 1], uid="u1")
    core.push(header, payload)
    assert core.version == 1
    second = join(core, key)  # a new session of the same client (or an attacker's)
    replay = UpdateHeader(**{**header.__dict__, "session": second, "update_id": "u2"})
    with pytest.raises(PermissionDenied, match="does not verify"):
        core.push(replay, payload)
    assert core.version == 1


def test_a_payload_re_signed_by_another_identity_is_refused() -> None:
    core = make_core(mode="async", buffer_size=1, min_clients=1, max_versions=5)
    victim, thief = NodeKey.generate(), NodeKey.generate()
    sv, st = join(core, victim), join(core, thief)
    header, payload = signed(core, sv, victim, [1, 1, 1, 1])
    core.push(header, payload)
    copied, _ = signed(core, st, thief, [1, 1, 1, 1], uid="mine")
    with pytest.raises(PermissionDenied, match="already counted from another client"):
        core.push(copied, payload)
    assert core.version == 1 and core.sessions[st].updates == 0
    # the victim's own retry is a duplicate, and its next, different update counts
    assert core.push(header, payload).duplicate is True
    nxt, nxt_payload = signed(core, sv, victim, [2, 2, 2, 2], uid="u2")
    assert core.push(nxt, nxt_payload).duplicate is False


def test_the_allow_list_admits_only_listed_keys(tmp_path) -> None:
    listed, stranger = NodeKey.generate(), NodeKey.generate()
    listed.save(tmp_path / "listed.key")
    core = make_core(allowed_keys=str(tmp_path / "listed.key.pub"))
    assert join(core, listed)
    with pytest.raises(PermissionDenied, match="allow-list"):
        join(core, stranger)
    assert len(core.sessions) == 1
    with pytest.raises(ValueError, match="cannot read allow-list"):
        make_core(allowed_keys=str(tmp_path / "missing.pub"))


def test_challenges_are_bounded(monkeypatch) -> None:
    from murmura.server import sessions as core_module  # where the challenges live

    monkeypatch.setattr(core_module, "MAX_CHALLENGES", 3)
    core = make_core()
    key = NodeKey.generate()
    oldest, _ = core.challenge()
    for _ in range(5):
        core.challenge()
    assert len(core._challenges) == 3
    with pytest.raises(Unauthenticated, match="unknown, used or expired"):
        core.join(key.client_id, DeviceProfile(), proof=key.join_proof(oldest))
