"""A peer refuses bad input over real gRPC with a precise status; its model is untouched."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
import torch

from murmura.client import TorchTrainer
from murmura.gossip import GossipConfig, GrpcPeerTransport, PeerRuntime
from murmura.gossip.answers import _push_fields
from murmura.protocols import PeerInfo, PeerModelHeader, serde
from murmura.protocols import murmura_pb2 as pb
from murmura.protocols.identity import NodeKey, peer_message
from murmura.tasks import ArrayDataset

pytestmark = pytest.mark.integration


def _runtime(peer_id: str) -> PeerRuntime:
    torch.manual_seed(0)
    data = ArrayDataset(np.zeros((8, 4), np.float32), np.zeros(8, np.int64))
    trainer = TorchTrainer(torch.nn.Linear(4, 2), data, device="cpu")
    return PeerRuntime(GrpcPeerTransport("127.0.0.1:0", timeout_s=5), trainer, peer_id=peer_id,
                       config=GossipConfig(rounds=1))


@pytest.fixture
def peers() -> Iterator[Callable[[str], PeerRuntime]]:
    """peers(id) -> a serving peer (no rounds run); every peer is stopped at teardown."""
    started: list[PeerRuntime] = []

    def start(peer_id: str) -> PeerRuntime:
        rt = _runtime(peer_id)
        rt.start()
        started.append(rt)
        return rt

    yield start
    for rt in started:
        rt.close()


def _push(address: str, items: list[pb.PeerChunk]) -> pb.PeerPushReply:
    with grpc.insecure_channel(address) as channel:
        push = channel.stream_unary("/murmura.v1.Peer/PushModel",
                                    request_serializer=pb.PeerChunk.SerializeToString,
                                    response_deserializer=pb.PeerPushReply.FromString)
        return push(iter(items), timeout=5)


def _items(rt: PeerRuntime, model: np.ndarray, *, sender: str = "other",
           address: str = "127.0.0.1:1", fingerprint: str | None = None,
           announced: int | None = None, message_id: str = "m1") -> list[pb.PeerChunk]:
    payload = model.astype(np.float32).tobytes()
    header = PeerModelHeader(sender=PeerInfo(sender, address), message_id=message_id, round=0,
                             num_examples=1, codec="dense-f32",
                             payload_bytes=len(payload) if announced is None else announced,
                             spec_fingerprint=rt.node.fingerprint if fingerprint is None
                             else fingerprint)
    return [pb.PeerChunk(header=serde.peer_model_header_to_proto(header)),
            pb.PeerChunk(data=payload)]


def _refused(rt: PeerRuntime, items: list[pb.PeerChunk]) -> grpc.RpcError:
    before = rt.node.model.copy()
    with pytest.raises(grpc.RpcError) as info:
        _push(rt.address, items)
    np.testing.assert_array_equal(rt.node.model, before)
    assert not rt.node.inbox
    return info.value


def test_a_valid_model_is_taken_and_a_retry_is_a_duplicate(peers) -> None:
    rt = peers("me")
    items = _items(rt, np.ones(rt.spec.size))

    assert not _push(rt.address, items).duplicate
    assert _push(rt.address, items).duplicate
    assert set(rt.node.inbox) == {"other"}


@pytest.mark.parametrize(("case", "code", "match"), [
    ("nan", grpc.StatusCode.INVALID_ARGUMENT, "non-finite"),
    ("short", grpc.StatusCode.INVALID_ARGUMENT, "does not decode"),
    ("spec", grpc.StatusCode.FAILED_PRECONDITION, "model spec"),
    ("oversized", grpc.StatusCode.INVALID_ARGUMENT, "at most"),
    ("more-than-announced", grpc.StatusCode.INVALID_ARGUMENT, "more than"),
    ("no-header", grpc.StatusCode.INVALID_ARGUMENT, "must begin with"),
    ("own-id", grpc.StatusCode.PERMISSION_DENIED, "own id"),
    ("bad-id", grpc.StatusCode.INVALID_ARGUMENT, "printable"),
])
def test_bad_pushes_get_a_precise_status_and_change_nothing(peers, case: str,
                                                            code: grpc.StatusCode,
                                                            match: str) -> None:
    rt = peers("me")
    size = rt.spec.size
    items = {
        "nan": lambda: _items(rt, np.full(size, np.nan)),
        "short": lambda: _items(rt, np.ones(size - 1)),
        "spec": lambda: _items(rt, np.ones(size), fingerprint="0" * 16),
        "oversized": lambda: _items(rt, np.ones(size), announced=1 << 30),
        "more-than-announced": lambda: _items(rt, np.ones(size), announced=8),
        "no-header": lambda: _items(rt, np.ones(size))[1:],
        "own-id": lambda: _items(rt, np.ones(size), sender="me"),
        "bad-id": lambda: _items(rt, np.ones(size), sender="x\n" * 100),
    }[case]()

    err = _refused(rt, items)

    assert err.code() == code
    assert match in err.details() and len(err.details()) < 200
    assert not _push(rt.address, _items(rt, np.ones(size))).duplicate  # still serving


def test_a_peer_claiming_a_live_peers_id_is_refused_and_a_dead_ones_rebinds(peers) -> None:
    victim, receiver = peers("victim"), peers("receiver")
    transport = GrpcPeerTransport(timeout_s=5)
    try:  # the victim introduces itself: its id is bound to its address
        transport.exchange(receiver.address, victim.node.me(), [], receiver.node.fingerprint)
    finally:
        transport.stop()

    err = _refused(receiver, _items(receiver, np.ones(receiver.spec.size), sender="victim",
                                    address="127.0.0.1:9"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "bound to another live address" in err.details()

    victim.close()  # the victim is gone: a restarted peer may take its id at a new address
    # (once the "alive" answer, remembered for probe_ttl_s, has expired)
    deadline = time.monotonic() + 5 * receiver.identity.probe_ttl_s
    while True:
        try:
            _push(receiver.address, _items(receiver, np.ones(receiver.spec.size),
                                           sender="victim", address="127.0.0.1:9"))
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.PERMISSION_DENIED
            assert time.monotonic() < deadline, "the dead victim's id never rebound"
            time.sleep(0.1)
    assert receiver.identity.address_of("victim") == "127.0.0.1:9"


def test_a_refused_push_binds_nothing(peers) -> None:
    rt = peers("me")
    size = rt.spec.size
    _refused(rt, _items(rt, np.ones(size), sender="squatter", fingerprint="0" * 16))
    assert rt.identity.address_of("squatter") is None
    # the id is still free for whoever first sends a model that is taken
    _push(rt.address, _items(rt, np.ones(size), sender="squatter", address="127.0.0.1:7"))
    assert rt.identity.address_of("squatter") == "127.0.0.1:7"


def test_pushes_from_many_fresh_ids_stop_at_the_inbox_bound(peers) -> None:
    rt = peers("me")
    rt.node.config = dataclasses.replace(rt.node.config, max_inbox=3)
    size = rt.spec.size
    for i in range(3):
        _push(rt.address, _items(rt, np.ones(size), sender=f"fresh{i}", message_id=f"m{i}"))
    before = rt.node.model.copy()
    with pytest.raises(grpc.RpcError) as info:
        _push(rt.address, _items(rt, np.ones(size), sender="fresh3", message_id="m3"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_inbox" in info.value.details()
    assert set(rt.node.inbox) == {"fresh0", "fresh1", "fresh2"}
    np.testing.assert_array_equal(rt.node.model, before)
    assert rt.identity.address_of("fresh3") is None


def _signed(rt: PeerRuntime, model: np.ndarray, key: NodeKey | None, *, sender: str = "s",
            address: str = "127.0.0.1:1", message_id: str = "m1",
            tamper: bool = False) -> list[pb.PeerChunk]:
    """A push signed as a deployed signing peer signs it (``key`` None: unsigned)."""
    payload = model.astype(np.float32).tobytes()
    me = PeerInfo(sender, address, 0, 0, key.public_bytes if key else b"")
    fields = _push_fields(message_id, 0, 1, "dense-f32", rt.node.fingerprint, payload)
    signature = key.sign(peer_message("push", sender, address, me.public_key, *fields)) \
        if key else b""
    header = PeerModelHeader(sender=me, message_id=message_id, round=0, num_examples=1,
                             codec="dense-f32", payload_bytes=len(payload),
                             spec_fingerprint=rt.node.fingerprint, signature=signature)
    if tamper:  # the signed bytes changed on the way
        payload = (model + 1).astype(np.float32).tobytes()
    return [pb.PeerChunk(header=serde.peer_model_header_to_proto(header)),
            pb.PeerChunk(data=payload)]


def test_a_signing_peers_id_is_bound_to_its_key_wherever_it_speaks_from(peers) -> None:
    rt = peers("me")
    key, other = NodeKey.from_seed("peer s"), NodeKey.from_seed("impostor")
    ones = np.ones(rt.spec.size)

    assert not _push(rt.address, _signed(rt, ones, key)).duplicate
    assert rt.identity.key_of("s") == key.public_bytes

    cases = [(_signed(rt, ones, other, message_id="m2"), "bound to another key"),
             (_signed(rt, ones, None, message_id="m3"), "signs its messages"),
             (_signed(rt, ones, key, message_id="m4", tamper=True), "does not verify")]
    rt.node.inbox.clear()
    for items, match in cases:
        err = _refused(rt, items)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and match in err.details()
    # the key speaks for the id from a new address (a restart), no liveness probe needed
    assert not _push(rt.address, _signed(rt, ones, key, message_id="m5",
                                         address="127.0.0.1:7")).duplicate
    assert rt.identity.address_of("s") == "127.0.0.1:7"


def test_a_network_that_requires_signatures_refuses_unsigned_peers(peers) -> None:
    torch.manual_seed(0)
    data = ArrayDataset(np.zeros((8, 4), np.float32), np.zeros(8, np.int64))
    rt = PeerRuntime(GrpcPeerTransport("127.0.0.1:0", timeout_s=5),
                     TorchTrainer(torch.nn.Linear(4, 2), data, device="cpu"), peer_id="strict",
                     config=GossipConfig(rounds=1, require_signatures=True))
    rt.start()
    try:
        err = _refused(rt, _items(rt, np.ones(rt.spec.size)))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not _push(rt.address, _signed(rt, np.ones(rt.spec.size),
                                             NodeKey.from_seed("k"))).duplicate
    finally:
        rt.close()


def test_signed_peers_train_together_and_bind_each_others_keys() -> None:
    # two signing peers over real gRPC: exchanges, pushes and goodbyes all verify
    keys = [NodeKey.from_seed(f"peer {i}") for i in range(2)]
    torch.manual_seed(0)
    data = ArrayDataset(np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32),
                        np.zeros(16, np.int64))
    cfg = GossipConfig(rounds=2, topology="ring", min_peers=2, round_timeout_s=10.0,
                       require_signatures=True)
    rts = [PeerRuntime(GrpcPeerTransport("127.0.0.1:0", timeout_s=5),
                       TorchTrainer(torch.nn.Linear(4, 2), data, device="cpu"),
                       peer_id=f"p{i}", config=cfg, key=keys[i],
                       model=np.zeros(10, np.float32)) for i in range(2)]
    first = rts[0].start()
    rts[1].bootstrap = [first]
    rts[1].start()
    threads = [threading.Thread(target=rt.run) for rt in rts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    for i, rt in enumerate(rts):
        assert rt.stats.mixed == 2 and not rt.stats.refusals
        assert rt.identity.key_of(f"p{1 - i}") == keys[1 - i].public_bytes


def test_an_exchange_with_another_model_spec_is_refused(peers) -> None:
    rt = peers("me")
    transport = GrpcPeerTransport(timeout_s=5)
    try:
        with pytest.raises(Exception, match="FAILED_PRECONDITION"):
            transport.exchange(rt.address, PeerInfo("x", "127.0.0.1:1"), [], "f" * 16)
    finally:
        transport.stop()
    assert len(rt.node.view) == 0


def test_step_logs_and_snapshots_are_refused_outside_seed_mode(peers) -> None:
    rt = peers("me")
    transport = GrpcPeerTransport(timeout_s=5)
    try:
        with pytest.raises(Exception, match="FAILED_PRECONDITION.*seed mode"):
            transport.pull_step_logs(rt.address, "x")
        with pytest.raises(Exception, match="FAILED_PRECONDITION.*seed mode"):
            transport.pull_model(rt.address, "x", snapshot=True)
    finally:
        transport.stop()


def test_implausible_step_logs_are_refused_before_any_replay() -> None:
    good = serde.step_logs_to_proto(2, b"s" * 32, [(2, [("a", b"x")]), (5, [("a", b"y")])])
    assert serde.step_logs_from_proto(good)[2][1] == (5, [("a", b"y")])
    for bad in (serde.step_logs_to_proto(2, b"short", []),
                serde.step_logs_to_proto(2, b"s" * 32, [(1, [("a", b"x")])]),  # before it
                serde.step_logs_to_proto(2, b"s" * 32, [(3, [("a", b"x")]), (3, [])]),
                serde.step_logs_to_proto(2, b"s" * 32, [(3, [])])):
        with pytest.raises(ValueError, match="step logs"):
            serde.step_logs_from_proto(bad)


@pytest.mark.parametrize("method", ["Exchange", "PushModel", "PullModel", "Health", "Goodbye",
                                    "PullStepLogs"])
def test_undecodable_bytes_get_invalid_argument(peers, method: str) -> None:
    rt = peers("receiver")
    before = rt.node.model.copy()
    garbage = b"\xff\xff\xff\xff\x0f" + b"\x80" * 20  # a field tag that no parser accepts
    path = f"/murmura.v1.Peer/{method}"
    with grpc.insecure_channel(rt.address) as ch, pytest.raises(grpc.RpcError) as err:
        if method == "PushModel":
            ch.stream_unary(path)(iter([garbage]), timeout=5)
        elif method == "PullModel":
            list(ch.unary_stream(path)(garbage, timeout=5))
        else:
            ch.unary_unary(path)(garbage, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in err.value.details()
    np.testing.assert_array_equal(rt.node.model, before)


def test_a_malformed_goodbye_is_refused_and_a_valid_one_drops_the_peer(peers) -> None:
    # Found by tests/integration/test_gossip_fuzz.py: a Goodbye took any id, so junk (and an
    # unbounded stream of ids) entered the peer's list of departed peers.
    rt = peers("me")
    with rt._lock:
        rt.node.merge([PeerInfo("gone", "127.0.0.1:9")])
    with grpc.insecure_channel(rt.address) as ch:
        goodbye = ch.unary_unary("/murmura.v1.Peer/Goodbye",
                                 request_serializer=pb.PeerExchange.SerializeToString,
                                 response_deserializer=pb.PeerPushReply.FromString)
        for bad in (PeerInfo("a\nb", "127.0.0.1:9"), PeerInfo("", "127.0.0.1:9"),
                    PeerInfo("gone", "no-port")):
            with pytest.raises(grpc.RpcError) as err:
                goodbye(pb.PeerExchange(sender=serde.peer_info_to_proto(bad)), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rt.node.view.ids() == ["gone"] and not rt.node.dead
        goodbye(pb.PeerExchange(sender=serde.peer_info_to_proto(
            PeerInfo("gone", "127.0.0.1:9"))), timeout=5)
    assert rt.node.view.ids() == [] and rt.node.dead == {"gone": "127.0.0.1:9"}
