"""SecAgg+ over gRPC: real clients on loopback, a real server, dropouts, and bad input.

The published model must equal plain FedAvg of the clients whose masked input arrived, within
the ring's quantisation; every malformed or out-of-order step is refused with its own status
and leaves the round as it was.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from murmura.client import ClientRuntime
from murmura.client.secagg import SecAggClient, SecAggLink
from murmura.client.trainer import FunctionTrainer
from murmura.client.transport import GrpcTransport, RemoteError
from murmura.protocols import DeviceProfile, ModelSpec, TaskSettings, UpdateHeader
from murmura.protocols import murmura_pb2 as pb
from murmura.protocols.identity import NodeKey, payload_digest
from murmura.protocols.secagg.ring import FieldSpec
from murmura.protocols.secagg.weighted import to_wire
from murmura.server import AggregatorCore, ServerConfig, ServerThread
from murmura.server.secagg import Stage
from tests.conftest import wait_until

pytestmark = pytest.mark.integration

TRAIN = TaskSettings(local_epochs=1, batch_size=8, lr=0.1, momentum=0.0)


class Died(Exception):
    """Raised by a step hook: the client process ends there."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 3))


def _trainer(index: int) -> FunctionTrainer:
    """A real torch model trained a few SGD steps on the client's own data."""
    gen = torch.Generator().manual_seed(100 + index)
    x = torch.randn(8 + 4 * index, 6, generator=gen)
    y = torch.randint(0, 3, (8 + 4 * index,), generator=gen)

    def fit(model: nn.Module, settings: TaskSettings, seed: int) -> dict[str, float]:
        opt = torch.optim.SGD(model.parameters(), lr=settings.lr)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return {"num_examples": float(len(x))}

    return FunctionTrainer(_model(), fit)


def _server(n: int, **cfg: Any) -> ServerThread:
    spec = ModelSpec.from_module(_model())
    flat: dict[str, Any] = dict(min_clients=n, cohort_size=n, max_versions=1,
                                secure_aggregation=True, secagg_step_timeout_s=4.0,
                                round_deadline_s=60.0, train=TRAIN)
    config = ServerConfig.from_flat(**{**flat, **cfg})
    core = AggregatorCore(config, spec, spec.flatten(_model()))
    return ServerThread(core, "127.0.0.1:0").start()


@pytest.fixture
def serve() -> Iterator[Callable[..., ServerThread]]:
    running: list[ServerThread] = []

    def start(n: int, **cfg: Any) -> ServerThread:
        srv = _server(n, **cfg)
        running.append(srv)
        return srv

    yield start
    for srv in running:
        srv.stop(grace=None)


def _client(address: str, index: int, updates: dict[int, tuple[np.ndarray, int]],
            die_before: str = "", leave: bool = False) -> ClientRuntime:
    transport = GrpcTransport(address, timeout_s=20.0)
    trainer = _trainer(index)
    examples = 8 + 4 * index

    def record(update: np.ndarray) -> np.ndarray:
        updates[index] = (update.copy(), examples)
        return update

    rt = ClientRuntime(transport, trainer, identity=NodeKey.generate(), wait_s=1.0,
                       update_hook=record)
    if die_before:
        def hook(stage: str) -> None:
            if stage == die_before:
                if not leave:
                    rt.session = ""  # a killed process sends no Leave
                raise Died(stage)
        rt.secagg_hook = hook
    return rt


def _run(rt: ClientRuntime) -> None:
    try:
        rt.run(max_tasks=1)
    except Died:
        pass
    finally:
        rt.transport.close()


def test_dropouts_before_and_after_the_masked_input_are_survived(
        serve: Callable[..., ServerThread], one_torch_thread: None) -> None:
    # Prepare: 10 clients (complete graph, t = 5); one killed and one leaving before the
    # masked input, one killed and one leaving after it (before the unmasking request): four
    # dropouts, the most that leaves every included client t answering neighbours
    n = 10
    srv = serve(n)
    updates: dict[int, tuple[np.ndarray, int]] = {}
    plan = {1: ("INPUT", False), 2: ("INPUT", True), 5: ("UNMASK", False), 6: ("UNMASK", True)}
    clients = [_client(srv.address, i, updates, *plan.get(i, ("", False))) for i in range(n)]
    # Execute
    threads = [threading.Thread(target=_run, args=(rt,), daemon=True) for rt in clients]
    for t in threads:
        t.start()
    assert srv.wait_done(timeout=90), "the round never published"
    for t in threads:
        t.join(timeout=30)
    # Assert: the model is the initial one plus plain FedAvg of the masked inputs that arrived
    survivors = [i for i in range(n) if i not in (1, 2)]
    w = np.array([updates[i][1] for i in survivors], dtype=np.float64)
    mean = (w[:, None] * np.stack([updates[i][0] for i in survivors])).sum(0) / w.sum()
    initial = ModelSpec.from_module(_model()).flatten(_model())
    got = srv.call(lambda: srv.core.params.copy())
    # Quantisation: each of the survivors' values is within half a step of its level, and
    # the sum is divided by the total weight (examples / max_weight); then float32 rounding.
    step = FieldSpec(bits=32, clip=1.0, n_max=n).step
    total_weight = w.sum() / 1000.0
    expected = initial + mean
    tolerance = len(survivors) * step / total_weight + 2 * np.spacing(np.abs(expected)
                                                                      .astype(np.float32))
    assert np.all(np.abs(got - expected) <= tolerance)
    assert np.abs(mean).max() > 1e4 * tolerance.max()  # the update is far from zero
    policy = srv.core.policy
    assert policy.secagg.stage == Stage.DONE and policy.secagg.result.count == len(survivors)


def _joined(address: str, n: int) -> list[tuple[GrpcTransport, NodeKey, str]]:
    out = []
    for _ in range(n):
        transport = GrpcTransport(address, timeout_s=10.0)
        key = NodeKey.generate()
        result, _ = transport.join_as(key, DeviceProfile())
        out.append((transport, key, result.session))
    return out


def _status(fn: Callable[[], object]) -> str:
    with pytest.raises(RemoteError) as info:
        fn()
    return info.value.status


def test_bad_steps_get_precise_statuses_and_change_nothing(
        serve: Callable[..., ServerThread]) -> None:
    # Prepare: three clients in a round at stage KEYS, a fourth outside the cohort
    srv = serve(3, secagg_step_timeout_s=120.0)  # no stage may time out while we probe it
    clients = _joined(srv.address, 3)
    for transport, _, session in clients:
        assert transport.task(session, 5.0).action.name == "TRAIN"
    outsider_t, outsider_k = GrpcTransport(srv.address, timeout_s=10.0), NodeKey.generate()
    outsider_session = outsider_t.join_as(outsider_k, DeviceProfile())[0].session
    policy = srv.core.policy
    params = srv.core.config.privacy.secagg_params()
    links = [t.secagg_link() for t, _, _ in clients]
    secrets = [SecAggClient(k.client_id, 1, params, identity=k, require_identity=True)
               for _, k, _ in clients]

    def keys_req(i: int, session: str | None = None, round_id: int = 1,
                 **over: bytes) -> pb.SecAggKeys:
        mask_pk, enc_pk, commit, sig = secrets[i].keys()
        fields = dict(mask_public_key=mask_pk, enc_public_key=enc_pk, self_commitment=commit,
                      signature=sig)
        fields.update(over)
        return pb.SecAggKeys(session=session or clients[i][2], round=round_id, **fields)

    # Execute and assert, step by step: each refusal leaves the round at KEYS with no keys
    assert _status(lambda: links[0].advertise(keys_req(0, round_id=7))) == "FAILED_PRECONDITION"
    assert _status(lambda: links[0].share(pb.SecAggShares(session=clients[0][2], round=1))) \
        == "FAILED_PRECONDITION"  # out of order: the round is at KEYS
    assert _status(lambda: links[0].advertise(keys_req(0, signature=b"\0" * 64))) \
        == "UNAUTHENTICATED"  # keys the join key did not sign: a substitution
    assert _status(lambda: links[0].advertise(keys_req(0, mask_public_key=b"short"))) \
        == "INVALID_ARGUMENT"
    outsider_link = outsider_t.secagg_link()
    assert _status(lambda: outsider_link.advertise(keys_req(0, session=outsider_session))) \
        == "PERMISSION_DENIED"  # a client not in the round
    assert srv.call(lambda: (policy.secagg.stage, dict(policy.secagg.keys))) == (Stage.KEYS, {})
    links[0].advertise(keys_req(0))
    assert _status(lambda: links[0].advertise(keys_req(0))) == "ALREADY_EXISTS"
    other = keys_req(1, mask_public_key=secrets[0].keys()[0])
    assert _status(lambda: links[1].advertise(other)) == "INVALID_ARGUMENT"  # a replayed key
    for i in (1, 2):
        links[i].advertise(keys_req(i))
    wait_until(lambda: srv.call(lambda: policy.secagg.stage) == Stage.SHARES, 10, "SHARES")
    # SHARES: an envelope for a client that is not a neighbour, then a valid sharing
    views = [links[i].poll(clients[i][2], 1, pb.SecAggState.KEYS, 5.0) for i in range(3)]
    from murmura.client.secagg import peers_from_proto

    envelopes = [secrets[i].share(v.index, v.threshold, v.n_max, peers_from_proto(v))
                 for i, v in enumerate(views)]
    bad = [pb.SecAggCiphertext(peer=j, ciphertext=ct) for j, ct in envelopes[0].items()]
    bad.append(pb.SecAggCiphertext(peer=99, ciphertext=bad[0].ciphertext))
    assert _status(lambda: links[0].share(pb.SecAggShares(session=clients[0][2], round=1,
                                                          shares=bad))) == "NOT_FOUND"
    assert srv.call(lambda: dict(policy.secagg.sent)) == {}
    for i in range(3):
        links[i].share(pb.SecAggShares(session=clients[i][2], round=1, shares=[
            pb.SecAggCiphertext(peer=j, ciphertext=ct) for j, ct in envelopes[i].items()]))
    wait_until(lambda: srv.call(lambda: policy.secagg.stage) == Stage.INPUT, 10, "INPUT")
    # INPUT: wrong length, then a value outside a narrower ring is impossible at 32 bits, so
    # send a masked input whose header lies about the codec; then the right ones
    views = [links[i].poll(clients[i][2], 1, pb.SecAggState.SHARES, 5.0) for i in range(3)]
    spec_size = srv.core.update_size
    rng = np.random.default_rng(0)
    masked = [secrets[i].masked_input({c.peer: c.ciphertext for c in v.ciphertexts},
                                      rng.normal(0, 0.01, spec_size), 10)
              for i, v in enumerate(views)]

    def send(i: int, payload: bytes, codec: str = params.codec) -> None:
        header = UpdateHeader(session=clients[i][2], update_id="x", base_version=0, round=1,
                              num_examples=0, codec=codec, payload_bytes=len(payload))
        header = clients[i][1].sign_update(header, payload_digest(payload))
        links[i].masked_input(header, payload)

    good = [to_wire(m, params) for m in masked]
    assert _status(lambda: send(0, good[0][:-4])) == "INVALID_ARGUMENT"  # wrong length
    assert _status(lambda: send(0, good[0], codec="dense-f32")) == "INVALID_ARGUMENT"
    forged = clients[0][1].sign_update(UpdateHeader(
        session=clients[0][2], update_id="x", base_version=0, round=1, num_examples=0,
        codec=params.codec, payload_bytes=len(good[0])), payload_digest(good[1]))
    assert _status(lambda: links[0].masked_input(forged, good[0])) == "UNAUTHENTICATED"
    assert srv.call(lambda: (set(policy.secagg.inputs), set(policy.secagg.inflight))) == \
        (set(), set())
    send(0, good[0])
    mine = views[0].index
    wait_until(lambda: srv.call(lambda: mine in policy.secagg.inputs), 10, "input counted")
    assert _status(lambda: send(0, good[0])) == "ALREADY_EXISTS"
    send(1, good[1])
    send(2, good[2])
    wait_until(lambda: srv.call(lambda: policy.secagg.stage) == Stage.UNMASK, 10, "UNMASK")
    # UNMASK: a share of a client the request does not name, a duplicate, then the answers
    view = links[0].poll(clients[0][2], 1, pb.SecAggState.INPUT, 5.0)
    shares = secrets[0].unmask(list(view.included), list(view.dropped))
    wrong = [pb.SecAggShare(owner=o, key=True, y=y.to_bytes(66, "big"))
             for (o, _), y in shares.items()]
    assert _status(lambda: links[0].unmask(pb.SecAggUnmask(session=clients[0][2], round=1,
                                                           shares=wrong))) == "NOT_FOUND"
    right = [pb.SecAggShare(owner=o, key=False, y=y.to_bytes(66, "big"))
             for (o, _), y in shares.items()]
    assert _status(lambda: links[0].unmask(pb.SecAggUnmask(
        session=clients[0][2], round=1, shares=right + right[:1]))) == "INVALID_ARGUMENT"
    assert srv.call(lambda: set(policy.secagg.answered)) == set()
    for i in range(3):
        v = links[i].poll(clients[i][2], 1, pb.SecAggState.INPUT, 5.0)
        ans = secrets[i].unmask(list(v.included), list(v.dropped))
        links[i].unmask(pb.SecAggUnmask(session=clients[i][2], round=1, shares=[
            pb.SecAggShare(owner=o, key=(k == "key"), y=y.to_bytes(66, "big"))
            for (o, k), y in ans.items()]))
    assert srv.wait_done(timeout=30)
    assert srv.call(lambda: policy.secagg.stage) == Stage.DONE
    for t, _, _ in clients:
        t.close()
    outsider_t.close()


def test_a_held_poll_is_not_re_viewed_for_changes_that_leave_its_stage(
        serve: Callable[..., ServerThread]) -> None:
    # Prepare: a round of three at stage KEYS; client 0 advertised and holds a poll for the
    # next stage; the round's views are counted
    srv = serve(3, secagg_step_timeout_s=120.0)
    clients = _joined(srv.address, 3)
    for transport, _, session in clients:
        assert transport.task(session, 5.0).action.name == "TRAIN"
    policy = srv.core.policy
    params = srv.core.config.privacy.secagg_params()
    links = [t.secagg_link() for t, _, _ in clients]
    secrets = [SecAggClient(k.client_id, 1, params, identity=k, require_identity=True)
               for _, k, _ in clients]

    def advertise(i: int) -> None:
        mask_pk, enc_pk, commit, sig = secrets[i].keys()
        links[i].advertise(pb.SecAggKeys(session=clients[i][2], round=1,
                                         mask_public_key=mask_pk, enc_public_key=enc_pk,
                                         self_commitment=commit, signature=sig))

    views = [0]
    view = policy.view

    def counted(rec: Any, round_id: int) -> Any:
        views[0] += 1
        return view(rec, round_id)

    policy.view = counted
    advertise(0)
    got: list[Any] = []
    poller = threading.Thread(target=lambda: got.append(
        links[0].poll(clients[0][2], 1, pb.SecAggState.KEYS, 20.0)))
    poller.start()
    wait_until(lambda: views[0] >= 1, 10, "the poll's first view")
    # Execute: five other clients join (each a change of the core, none of the round's
    # stage), then the last two members advertise
    others = _joined(srv.address, 5)
    viewed_while_joining = views[0]
    advertise(1)
    advertise(2)
    poller.join(timeout=10)
    # Assert: the joins woke the poll without a view of the round; the stage's move
    # answered it with the next stage
    assert viewed_while_joining == 1, viewed_while_joining
    assert got and got[0].stage == pb.SecAggState.SHARES
    for transport, _, _ in clients + others:
        transport.close()


def test_push_is_refused_and_no_service_without_secure_aggregation(
        serve: Callable[..., ServerThread]) -> None:
    srv = serve(2)
    (transport, key, session), _ = _joined(srv.address, 2)
    payload = np.zeros(srv.core.update_size, np.float32).tobytes()
    header = key.sign_update(UpdateHeader(
        session=session, update_id="u", base_version=0, round=1, num_examples=1,
        codec="dense-f32", payload_bytes=len(payload),
        spec_fingerprint=srv.core.fingerprint), payload_digest(payload))
    transport.task(session, 5.0)
    assert _status(lambda: transport.push(header, payload)) == "FAILED_PRECONDITION"
    transport.close()
    plain = ServerThread(AggregatorCore(ServerConfig.from_flat(min_clients=2),
                                        srv.core.spec, srv.core.params), "127.0.0.1:0").start()
    try:
        link = SecAggLink(grpc.insecure_channel(plain.address), timeout_s=5.0)
        assert _status(lambda: link.poll("s", 1, 0, 0.0)) == "UNIMPLEMENTED"
    finally:
        plain.stop(grace=None)


def test_async_fedbuff_groups_run_over_grpc(serve: Callable[..., ServerThread],
                                             one_torch_thread: None) -> None:
    # Prepare: FedBuff buffers of 3 as masked groups, 6 clients training continuously
    n = 6
    srv = serve(n, mode="async", buffer_size=3, max_versions=3, cohort_size=0)
    updates: dict[int, tuple[np.ndarray, int]] = {}
    clients = [_client(srv.address, i, updates) for i in range(n)]

    def loop(rt: ClientRuntime) -> None:
        try:
            rt.run()
        finally:
            rt.transport.close()

    threads = [threading.Thread(target=loop, args=(rt,), daemon=True) for rt in clients]
    # Execute
    for t in threads:
        t.start()
    assert srv.wait_done(timeout=90), "the async run never reached its last version"
    for t in threads:
        t.join(timeout=30)
    # Assert: three versions, each from a masked group of 3, nothing pushed in the clear
    core = srv.core
    assert core.version == 3
    assert srv.call(lambda: core.traffic.updates) >= 9
    assert sum(rt.stats.pushed for rt in clients) >= 9
    assert "FAILED_PRECONDITION: push under secure aggregation" not in \
        srv.call(lambda: dict(core.traffic.refused_by_reason))


def test_a_client_that_requires_secure_aggregation_refuses_a_plain_server() -> None:
    spec = ModelSpec.from_module(_model())
    plain = ServerThread(AggregatorCore(ServerConfig.from_flat(min_clients=1, train=TRAIN),
                                        spec, spec.flatten(_model())), "127.0.0.1:0").start()
    try:
        transport = GrpcTransport(plain.address, timeout_s=10.0)
        rt = ClientRuntime(transport, _trainer(0), identity=NodeKey.generate(), wait_s=1.0,
                           require_secagg=True)
        with pytest.raises(ValueError, match="does not run secure aggregation"):
            rt.run(max_tasks=1)
        transport.close()
        assert plain.call(lambda: (len(plain.core.sessions), plain.core.traffic.updates)) \
            == (0, 0)  # it left at once, and sent nothing
    finally:
        plain.stop(grace=None)
