"""Fuzzing every RPC of a live loopback server with hypothesis.

Each case is a random message, a structured message with hostile field values, or a valid
request with one byte changed. Whatever arrives, the server answers with a specific status
(never UNKNOWN or INTERNAL), a refused request changes neither the global model nor any
counter but the refusal counts, and an honest client still trains to a new version at the end.

The default suite runs a few dozen cases per RPC; ``pytest -m fuzz`` runs 10,000 per RPC (CI's
second step).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from murmura.protocols import ModelSpec, TensorSpec, serde
from murmura.protocols import murmura_pb2 as pb
from murmura.server import AggregatorCore, ServerConfig, ServerThread

pytestmark = pytest.mark.integration

SIZE = 8
SPEC = ModelSpec((TensorSpec("w", (SIZE,)),))
#: Statuses a refusal may carry; anything else (UNKNOWN, INTERNAL, ...) is a server bug.
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ABORTED}
BUDGETS = [pytest.param(40, id="quick"),
           pytest.param(10_000, id="10k", marks=[pytest.mark.fuzz, pytest.mark.slow])]


class Target:
    """A live server, a raw channel and an honest session to fuzz against."""

    def __init__(self) -> None:
        # Rate limits off: the fuzzer is one identity sending thousands of requests a second,
        # and a RESOURCE_EXHAUSTED for each would hide what the handlers do with the input.
        # Identities off, so that fuzzed pushes reach decoding and the policy rather than all
        # stopping at the missing signature (tests/security covers the signed path).
        config = ServerConfig.from_flat(mode="async", min_clients=1, buffer_size=10**9,
                                        max_versions=10**9, max_staleness=10**9, workers=0,
                                        join_per_s=0, push_per_s=0, max_payload_mb=1.0,
                                        require_identity=False)
        self.core = AggregatorCore(config, SPEC, np.zeros(SIZE, np.float32))
        self.server = ServerThread(self.core, "127.0.0.1:0").start()
        self.channel = grpc.insecure_channel(self.server.address)
        self.session = self.raw("Join", pb.JoinRequest(client_id="honest").SerializeToString())
        self.session = pb.JoinReply.FromString(self.session).session

    def raw(self, method: str, data: bytes | list[bytes]) -> bytes:
        """Send request bytes as they are; the reply's bytes (a Pull's are concatenated)."""
        path = f"/murmura.v1.Aggregator/{method}"
        if method == "Push":
            frames = data if isinstance(data, list) else [data]
            return self.channel.stream_unary(path)(iter(frames), timeout=10)
        if method == "Pull":
            return b"".join(self.channel.unary_stream(path)(data, timeout=10))
        return self.channel.unary_unary(path)(data, timeout=10)

    def state(self) -> tuple[int, int, bytes, int]:
        core = self.core
        return self.server.call(lambda: (core.version, core.traffic.updates,
                                         core.params.tobytes(), len(core.sessions)))

    def refusals(self) -> int:
        return self.server.call(lambda: sum(self.core.traffic.refused.values()))

    def expect(self, method: str, data: bytes | list[bytes], *, may_change: bool) -> None:
        """Call, and check the status and what the call may have changed."""
        before, refused = self.state(), self.refusals()
        try:
            self.raw(method, data)
        except grpc.RpcError as exc:
            assert exc.code() in ALLOWED, (method, exc.code(), exc.details())
            assert len(exc.details()) < 400
            after = self.state()
            assert after[:3] == before[:3], f"a refused {method} changed the model or counters"
            assert self.refusals() == refused + 1, f"a refused {method} was not counted"
            return
        if not may_change:
            assert self.state()[:3] == before[:3]

    def close(self) -> None:
        self.channel.close()
        self.server.stop(grace=None)


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    t = Target()
    yield t
    # The server survived: an honest client still takes its turn. It joins again first: a
    # fuzzed push under its session with another model's spec ended that session (a refusal
    # no retry can fix closes the session, so sync rounds do not wait for it).
    reply = t.raw("Join", pb.JoinRequest(client_id="honest").SerializeToString())
    t.session = pb.JoinReply.FromString(reply).session
    payload = np.ones(SIZE, "<f4").tobytes()
    header = pb.UpdateHeader(session=t.session, update_id=uuid.uuid4().hex, num_examples=1,
                             codec="dense-f32", payload_bytes=len(payload),
                             spec_fingerprint=SPEC.fingerprint())
    before = t.state()[1]
    t.raw("Push", [pb.UpdateChunk(header=header).SerializeToString(),
                   serde.frame_data(payload)])
    assert t.state()[1] == before + 1
    t.close()


def fuzz(budget: int):  # noqa: ANN201 - a hypothesis settings decorator
    return settings(max_examples=budget, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


texts = st.one_of(st.text(max_size=40), st.text(min_size=200, max_size=2000),
                  st.sampled_from(["", "a\nb", "\x00", "dense-f32", "seed", "partial"]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([math.nan, math.inf, -math.inf, 1.7e38, -0.0, 5e-324]))
ints = st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-3, 10))
mutation = st.tuples(st.integers(min_value=0), st.integers(0, 255))


def mutate(data: bytes, where_what: tuple[int, int]) -> bytes:
    where, what = where_what
    if not data:
        return bytes([what])
    buf = bytearray(data)
    buf[where % len(buf)] = what
    return bytes(buf)


@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_join(target: Target, budget: int) -> None:
    profiles = st.builds(pb.DeviceProfile, device=texts, device_name=texts,
                         memory_bytes=ints, steps_per_s=floats, cpu_count=st.integers(-5, 1 << 30),
                         extra=st.dictionaries(texts, texts, max_size=20))
    requests = st.builds(pb.JoinRequest, client_id=texts, profile=profiles, token=texts,
                         protocol_version=st.integers(0, (1 << 32) - 1))

    @fuzz(budget)
    @given(st.one_of(requests.map(lambda r: r.SerializeToString()), st.binary(max_size=300),
                     st.tuples(requests, mutation).map(
                         lambda rm: mutate(rm[0].SerializeToString(), rm[1]))))
    def run(data: bytes) -> None:
        target.expect("Join", data, may_change=True)  # an accepted Join adds a session
    run()


@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_challenge(target: Target, budget: int) -> None:
    @fuzz(budget)
    @given(st.binary(max_size=300))
    def run(data: bytes) -> None:
        target.expect("Challenge", data, may_change=True)  # a nonce is state, not the model
    run()


@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_get_task(target: Target, budget: int) -> None:
    waits = st.one_of(floats.filter(lambda f: not 0 < f), st.just(0.0))  # never hold the call

    @fuzz(budget)
    @given(st.one_of(
        st.builds(pb.TaskRequest, session=st.one_of(texts, st.just(target.session)),
                  wait_s=waits).map(lambda r: r.SerializeToString()),
        st.binary(max_size=300)))
    def run(data: bytes) -> None:
        target.expect("GetTask", data, may_change=False)
    run()


@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_pull(target: Target, budget: int) -> None:
    @fuzz(budget)
    @given(st.one_of(
        st.builds(pb.PullRequest, session=st.one_of(texts, st.just(target.session)),
                  kind=st.integers(-(1 << 31), (1 << 31) - 1)).map(lambda r: r.SerializeToString()),
        st.binary(max_size=300)))
    def run(data: bytes) -> None:
        target.expect("Pull", data, may_change=False)
    run()


@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_leave(target: Target, budget: int) -> None:
    @fuzz(budget)
    @given(st.one_of(
        st.builds(pb.LeaveRequest, session=texts, reason=texts).map(
            lambda r: r.SerializeToString()),
        st.binary(max_size=300)))
    def run(data: bytes) -> None:
        target.expect("Leave", data, may_change=True)
    run()


@pytest.mark.parametrize("budget", BUDGETS)
def test_fuzz_push(target: Target, budget: int) -> None:
    def valid(values: list[float]) -> list[bytes]:
        with np.errstate(over="ignore"):  # float64 values beyond float32 become inf: good
            payload = np.asarray(values, "<f4").tobytes()
        header = pb.UpdateHeader(session=target.session, update_id=uuid.uuid4().hex,
                                 num_examples=3, codec="dense-f32", payload_bytes=len(payload),
                                 spec_fingerprint=SPEC.fingerprint())
        return [pb.UpdateChunk(header=header).SerializeToString(),
                serde.frame_data(payload[:10]), serde.frame_data(payload[10:])]

    headers = st.builds(
        pb.UpdateHeader, session=st.one_of(texts, st.just(target.session)), update_id=texts,
        base_version=ints, round=ints, num_examples=ints, codec=texts,
        payload_bytes=st.one_of(ints, st.just(4 * SIZE)),
        metrics=st.dictionaries(texts, floats, max_size=40),
        spec_fingerprint=st.one_of(texts, st.just(SPEC.fingerprint())))
    hostile_headers = st.tuples(headers, st.binary(max_size=64)).map(
        lambda hp: [pb.UpdateChunk(header=hp[0]).SerializeToString(),
                    serde.frame_data(hp[1])])
    values = st.lists(floats, min_size=SIZE, max_size=SIZE)
    one_byte = st.tuples(values, st.integers(0, 2), mutation).map(
        lambda v: [mutate(f, v[2]) if i == v[1] else f for i, f in enumerate(valid(v[0]))])
    random_frames = st.lists(st.binary(max_size=80), min_size=0, max_size=4)

    @fuzz(budget)
    @given(st.one_of(hostile_headers, one_byte, random_frames, values.map(valid)))
    def run(frames: list[bytes]) -> None:
        # A mutated update may still be a valid one (finite values, right length): it then
        # counts, and may change the model; a refused one must change nothing.
        target.expect("Push", frames, may_change=True)
    run()
