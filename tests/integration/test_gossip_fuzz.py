"""Fuzzing every RPC of a live loopback gossip peer with hypothesis.

Two peers are fuzzed: one that mixes whole models (Sybil weighting on, so gossiped history
records are parsed too) and one in seed mode (zeroth-order trainer, codec ``seed``, a step
journal), so PullStepLogs, snapshot pulls and step-log pushes meet hostile input as well.
Each case is random bytes, a structured message with hostile field values, or a valid request
with one byte changed. Whatever arrives, the peer answers with a specific status (never
UNKNOWN or INTERNAL, never a hang: every call has a deadline); no request changes the peer's
model or round, a refused one changes neither its inbox nor its view; and at the end an honest
push is taken and mixed by a real round, an honest Exchange succeeds and Health answers.

The default suite runs a few dozen cases per RPC; ``pytest -m fuzz`` runs 10,000 per RPC.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from murmura.client import TorchTrainer
from murmura.client.zo import ZOTrainer
from murmura.gossip import GossipConfig, GrpcPeerTransport, PeerRuntime
from murmura.gossip.identity import well_formed
from murmura.protocols import PeerInfo, PeerModelHeader, create_codec, serde
from murmura.protocols import murmura_pb2 as pb
from murmura.protocols.codecs import available_codecs
from murmura.protocols.codecs._util import HEADER_BYTES
from murmura.protocols.codecs.seed import ZOSteps
from murmura.tasks import ArrayDataset

pytestmark = pytest.mark.integration

#: Statuses a refusal may carry; anything else (UNKNOWN, INTERNAL, DEADLINE_EXCEEDED) is a bug.
#: UNAVAILABLE only from a peer that is leaving, which these peers never are while fuzzed.
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ABORTED,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
BUDGETS = [pytest.param(30, id="quick"),
           pytest.param(10_000, id="10k", marks=[pytest.mark.fuzz, pytest.mark.slow])]
#: Addresses a fuzzed peer may dial (the id-binding liveness probe): closed loopback ports,
#: so a probe fails at once instead of waiting out a deadline.
DEAD = ["127.0.0.1:1", "127.0.0.1:9", "[::1]:1"]


class Target:
    """A live peer (not running rounds, so only requests change it) and a raw channel."""

    def __init__(self, seed_mode: bool) -> None:
        torch.manual_seed(0)
        data = ArrayDataset(np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32),
                            np.arange(8, dtype=np.int64) % 2)
        self.seed_mode = seed_mode
        if seed_mode:
            trainer: Any = ZOTrainer(torch.nn.Linear(4, 2), data, device="cpu")
            config = GossipConfig(rounds=100, seed_mode=True, round_timeout_s=0.05,
                                  local_steps=4, max_round_lag=2)
        else:
            trainer = TorchTrainer(torch.nn.Linear(4, 2), data, device="cpu")
            config = GossipConfig(rounds=100, sybil=True, round_timeout_s=0.05,
                                  max_round_lag=2)
        self.rt = PeerRuntime(GrpcPeerTransport("127.0.0.1:0", timeout_s=3), trainer,
                              peer_id="fuzzed", config=config)
        self.rt.start()
        self.address = self.rt.address
        self.size = self.rt.spec.size
        self.fingerprint = self.rt.node.fingerprint
        if seed_mode:
            # Two real rounds (alone: each mixes only its own step log), so the journal holds
            # step logs and PullStepLogs has something to send; then the peer is mid-round 2,
            # as while training, holding the bases of rounds 0..2 for replaying pushes.
            for _ in range(2):
                self.rt.step()
            with self.rt._lock:
                self.rt.node.start_round(self.rt.node.round)
            assert self.rt.node.journal is not None and self.rt.node.journal.rounds
        self.channel = grpc.insecure_channel(self.address)

    def raw(self, method: str, data: bytes | list[bytes]) -> bytes:
        """Send request bytes as they are; the reply's bytes (a PullModel's concatenated)."""
        path = f"/murmura.v1.Peer/{method}"
        if method == "PushModel":
            frames = data if isinstance(data, list) else [data]
            return self.channel.stream_unary(path)(iter(frames), timeout=10)
        if method == "PullModel":
            return b"".join(self.channel.unary_stream(path)(data, timeout=10))
        return self.channel.unary_unary(path)(data, timeout=10)

    def state(self) -> dict[str, Any]:
        """Everything a request could change, as comparable values."""
        rt = self.rt
        with rt._lock:
            node = rt.node
            journal = node.journal
            return {
                "model": node.model.tobytes(), "round": node.round,
                "inbox": sorted((s, r, m.model.tobytes(), m.num_examples, m.payload)
                                for s, rounds in node.inbox.items() for r, m in rounds.items()),
                "early": [(h.message_id, h.round, p) for h, p in rt._early],
                "bases": {r: b.tobytes() for r, b in node.bases.items()},
                "journal": None if journal is None else (
                    journal.snapshot_round, journal.snapshot.tobytes(), journal.entries()),
                "view": node.view.entries(), "dead": dict(node.dead),
                "records": list(node.records),
            }

    def expect(self, method: str, data: bytes | list[bytes]) -> None:
        """Call, and check the status and what the call changed."""
        before = self.state()
        try:
            reply = self.raw(method, data)
        except grpc.RpcError as exc:
            assert exc.code() in ALLOWED, (method, exc.code(), exc.details())
            assert len(exc.details()) < 400
            assert self.state() == before, f"a refused {method} changed the peer"
            return
        after = self.state()
        # Junk never enters the view or the departed list (it would spread to other peers).
        assert all(well_formed(e.peer_id, e.address) for e in after["view"]), method
        assert all(well_formed(p, a) for p, a in after["dead"].items()), method
        # Only mixing (a round) moves the model, the round, the bases or the journal.
        for key in ("model", "round", "bases", "journal"):
            assert after[key] == before[key], f"an accepted {method} changed the {key}"
        if method != "PushModel":
            assert after["inbox"] == before["inbox"] and after["early"] == before["early"]
        if method in ("PullModel", "PullStepLogs", "Health"):
            assert after == before, f"a {method} changed the peer"
        if method == "Health":
            assert pb.PeerHealthReply.FromString(reply).peer_id == "fuzzed"
        if method == "PullStepLogs":  # what it sends is what a catching-up peer accepts
            serde.step_logs_from_proto(pb.PeerStepLogs.FromString(reply))

    def close(self) -> None:
        self.channel.close()
        self.rt.close()


def _seed_payload(lr: float, seeds: list[int], grads: list[float]) -> bytes:
    """A step log as a hostile sender may write it (any lr and scalars: no sender checks)."""
    with np.errstate(over="ignore"):
        steps = ZOSteps(0.01, np.asarray(seeds, np.uint64), np.asarray(grads, np.float32))
        payload = bytearray(create_codec("seed").pack(steps))  # type: ignore[attr-defined]
        payload[HEADER_BYTES:HEADER_BYTES + 4] = np.float32(lr).astype("<f4").tobytes()
    return bytes(payload)


def _frames(header: PeerModelHeader, payload: bytes) -> list[bytes]:
    """A push as the wire carries it: the header, then the payload in two data frames."""
    cut = len(payload) // 2
    return [pb.PeerChunk(header=serde.peer_model_header_to_proto(header)).SerializeToString(),
            serde.frame_data(payload[:cut]), serde.frame_data(payload[cut:])]


def _honest(t: Target, round_: int, sender: str) -> list[bytes]:
    if t.seed_mode:
        codec, payload = "seed", _seed_payload(0.01, [1, 2, 3], [0.5, -0.25, 1.0])
    else:
        codec, payload = "dense-f32", np.full(t.size, 0.5, "<f4").tobytes()
    header = PeerModelHeader(sender=PeerInfo(sender, DEAD[0]), message_id=uuid.uuid4().hex,
                             round=round_, num_examples=4, codec=codec,
                             payload_bytes=len(payload), spec_fingerprint=t.fingerprint)
    return _frames(header, payload)


@pytest.fixture(scope="module", params=["dense", "seed"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    t = Target(seed_mode=request.param == "seed")
    try:
        yield t
        # The peer survived: Health answers, an honest Exchange succeeds, and an honest push
        # is taken and mixed by a real round.
        health = pb.PeerHealthReply.FromString(t.raw("Health", b""))
        assert health.peer_id == "fuzzed"
        me = PeerInfo(f"honest-{uuid.uuid4().hex[:8]}", DEAD[1])
        caller = GrpcPeerTransport(timeout_s=5)
        try:
            partner, _, _ = caller.exchange(t.address, me, [], t.fingerprint)
        finally:
            caller.stop()
        assert partner.peer_id == "fuzzed"
        r = health.round
        sender = f"honest-{uuid.uuid4().hex[:8]}"
        reply = pb.PeerPushReply.FromString(t.raw("PushModel", _honest(t, r, sender)))
        assert not reply.duplicate and reply.round == r
        assert r in t.rt.node.inbox[sender]
        # Fuzzed Exchanges filled the view with hostile addresses; a round would dial them.
        # What is tested here is mixing, so the round runs with an empty view.
        with t.rt._lock:
            for peer in t.rt.node.view.ids():
                t.rt.node.view.remove(peer)
        before = t.rt.node.model.copy()
        report = t.rt.step()
        # (a round may jump ahead: models of later rounds pull a peer to the newest mixed)
        assert report.round == r and report.mixed >= 1 and t.rt.node.round > r
        assert sender not in t.rt.node.inbox
        assert not np.array_equal(t.rt.node.model, before)
        assert np.isfinite(t.rt.node.model).all()
    finally:
        t.close()


def fuzz(budget: int):  # noqa: ANN201 - a hypothesis settings decorator
    return settings(max_examples=budget, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


# long strings repeat a short one: as hostile to the peer, far cheaper to generate
long_texts = st.builds(lambda s, n: s * n, st.text(min_size=1, max_size=8), st.integers(25, 250))
texts = st.one_of(st.text(max_size=40), long_texts,
                  st.sampled_from(["", "a\nb", "\x00", "dense-f32", "seed", "topk", "fuzzed"]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([math.nan, math.inf, -math.inf, 1.7e38, -0.0, 5e-324]))
ints = st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-3, 10))
rounds = st.one_of(ints, st.integers(-1, 14))
ids = st.one_of(texts, st.sampled_from(["fuzzed", "peer-1", "peer-2", "x" * 129, " ", "é"]))
addresses = st.one_of(st.sampled_from([*DEAD, "", "nocolon", ":", "127.0.0.1:" + "9" * 300]),
                      texts)
mutation = st.tuples(st.integers(min_value=0), st.integers(0, 255))
# public_key: empty (an unsigned peer), 32 random bytes (an Ed25519 key that signed nothing
# here), or junk of other sizes
peer_infos = st.builds(pb.PeerInfo, peer_id=ids, address=addresses, round=ints, age=ints,
                       public_key=st.one_of(st.just(b""), st.binary(min_size=32, max_size=32),
                                            st.binary(max_size=40)))
# Sketches: the right size (finite, or poisoned) and wrong sizes.
SKETCHES = [np.zeros(512).tolist(), np.full(512, 0.5).tolist(), [math.nan] * 512,
            [math.inf] * 512, [1.0] * 511, [1.0] * 513]
history = st.builds(pb.HistoryRecord, peer_id=ids, round=rounds,
                    sketch=st.one_of(st.sampled_from(SKETCHES), st.lists(floats, max_size=20)))
short_history = st.builds(pb.HistoryRecord, peer_id=ids, round=rounds)


def mutate(data: bytes, where_what: tuple[int, int]) -> bytes:
    where, what = where_what
    if not data:
        return bytes([what])
    buf = bytearray(data)
    buf[where % len(buf)] = what
    return bytes(buf)


def exchanges(t: Target) -> st.SearchStrategy[pb.PeerExchange]:
    short = st.builds(pb.PeerInfo, peer_id=st.sampled_from(["peer-1", "a\nb"]),
                      address=st.sampled_from(DEAD), round=rounds)
    many = st.builds(lambda p, n: [p] * n, short, st.sampled_from([1024, 1025]))
    return st.builds(
        pb.PeerExchange, sender=peer_infos,
        peers=st.one_of(st.lists(peer_infos, max_size=6), many),
        spec_fingerprint=st.one_of(texts, st.just(t.fingerprint)),
        signature=st.binary(max_size=64),
        history=st.one_of(st.lists(history, max_size=4),
                          st.builds(lambda h: [h] * 1025, short_history)))


def _cases(structured: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Structured messages, random bytes, and structured messages with one byte changed."""
    return st.one_of(structured.map(lambda m: m.SerializeToString()), st.binary(max_size=300),
                     st.tuples(structured, mutation).map(
                         lambda mm: mutate(mm[0].SerializeToString(), mm[1])))


@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_exchange(target: Target, budget: int) -> None:
    @fuzz(budget)
    @given(_cases(exchanges(target)))
    def run(data: bytes) -> None:
        target.expect("Exchange", data)
    run()


@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_goodbye(target: Target, budget: int) -> None:
    @fuzz(budget)
    @given(_cases(exchanges(target)))
    def run(data: bytes) -> None:
        target.expect("Goodbye", data)
    run()


@pytest.mark.parametrize("method", ["PullModel", "PullStepLogs"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_pulls(target: Target, budget: int, method: str) -> None:
    requests = st.builds(pb.PeerPullRequest, peer_id=ids, snapshot=st.booleans())

    @fuzz(budget)
    @given(_cases(requests))
    def run(data: bytes) -> None:
        target.expect(method, data)
    run()


@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_health(target: Target, budget: int) -> None:
    @fuzz(budget)
    @given(_cases(st.just(pb.PeerHealthRequest())))
    def run(data: bytes) -> None:
        target.expect("Health", data)
    run()


@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_push_model(target: Target, budget: int) -> None:
    t = target
    codec = "seed" if t.seed_mode else "dense-f32"

    def valid(sender: str, address: str, round_: int, payload: bytes) -> list[bytes]:
        header = PeerModelHeader(sender=PeerInfo(sender, address), message_id=uuid.uuid4().hex,
                                 round=round_, num_examples=3, codec=codec,
                                 payload_bytes=len(payload), spec_fingerprint=t.fingerprint)
        return _frames(header, payload)

    def dense(values: list[float]) -> bytes:
        with np.errstate(over="ignore"):  # float64 values beyond float32 become inf: good
            return np.asarray(values, "<f4").tobytes()

    def seed(lr: float, steps: list[tuple[int, float]]) -> bytes:
        return _seed_payload(lr, [s for s, _ in steps], [g for _, g in steps])

    if t.seed_mode:
        payloads = st.builds(seed, st.one_of(st.just(0.01), floats.filter(lambda f: f >= 0)),
                             st.lists(st.tuples(st.integers(0, (1 << 32) - 1), floats),
                                      max_size=6))
    else:
        payloads = st.lists(floats, min_size=t.size, max_size=t.size).map(dense)
    senders = st.sampled_from(["peer-1", "peer-2", "peer-3"])
    valid_pushes = st.builds(valid, senders, st.sampled_from(DEAD[:1]), st.integers(-1, 14),
                             payloads)
    headers = st.builds(
        pb.PeerModelHeader, sender=peer_infos, message_id=texts, round=rounds,
        num_examples=ints, codec=st.one_of(texts, st.sampled_from(available_codecs())),
        payload_bytes=st.one_of(ints, st.sampled_from([4 * t.size, 28])),
        spec_fingerprint=st.one_of(texts, st.just(t.fingerprint)),
        signature=st.binary(max_size=32))
    hostile_headers = st.tuples(headers, st.binary(max_size=64)).map(
        lambda hp: [pb.PeerChunk(header=hp[0]).SerializeToString(), serde.frame_data(hp[1])])
    one_byte = st.tuples(valid_pushes, st.integers(0, 2), mutation).map(
        lambda v: [mutate(f, v[2]) if i == v[1] else f for i, f in enumerate(v[0])])
    random_frames = st.lists(st.binary(max_size=80), min_size=0, max_size=4)
    # a valid push whose header comes twice, or whose payload is split by a second header
    doubled = valid_pushes.map(lambda f: [f[0], f[1], f[0], f[2]])

    @fuzz(budget)
    @given(st.one_of(hostile_headers, one_byte, random_frames, valid_pushes, doubled))
    def run(frames: list[bytes]) -> None:
        t.expect("PushModel", frames)
    run()
