"""Hierarchical aggregation: clients -> leaves -> middle -> top over real gRPC on loopback."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from murmura.client import ClientRuntime, FunctionTrainer, GrpcTransport, RemoteError, RetryPolicy
from murmura.protocols import DeviceProfile, ModelSpec, UpdateHeader
from murmura.protocols.codecs.partial import encode_partial
from murmura.protocols.identity import NodeKey, payload_digest
from murmura.server import ServerConfig, ServerThread, build_core
from murmura.server.leaf import Leaf
from murmura.tasks import TaskConfig, load_task

pytestmark = pytest.mark.integration

TASK = TaskConfig(task="digits", model="mlp", partition="iid")
TASK_FINGERPRINT = ModelSpec.from_module(load_task(TASK).build_model(seed=0)).fingerprint()
VERSIONS = 3


def client_fn(index: int):  # noqa: ANN201
    """A deterministic 'training' step: the update depends only on (client, model)."""
    def fn(model: torch.nn.Module, settings, seed) -> dict[str, float]:
        with torch.no_grad():
            for k, p in enumerate(model.parameters()):
                p.add_(0.01 * torch.tanh(p * (index + 1)) + 1e-4 * (index - 1.5) * (k + 1))
        return {"num_examples": 10 + index}
    return fn


def run_clients(addresses: list[str]) -> list[threading.Thread]:
    task = load_task(TASK)
    threads = []
    for i, address in enumerate(addresses):
        trainer = FunctionTrainer(task.build_model(), client_fn(i))
        # seeded keys: the same client ids (and so fold order) in every run
        runtime = ClientRuntime(GrpcTransport(address, timeout_s=30), trainer,
                                identity=NodeKey.from_seed(f"client-{i}"), wait_s=2.0,
                                retry=RetryPolicy(initial_s=0.05, give_up_after_s=60))
        th = threading.Thread(target=runtime.run, daemon=True)
        th.start()
        threads.append(th)
    return threads


def top_config(accumulator: str, min_clients: int, leaf_keys: str = "") -> ServerConfig:
    return ServerConfig.from_flat(mode="sync", min_clients=min_clients, max_versions=VERSIONS,
                                  accumulator=accumulator, workers=0, leaf_keys=leaf_keys)


def leaf_config(upstream: str, name: str, accumulator: str, keys: Path,
                leaf_keys: str = "", **tier: object) -> ServerConfig:
    tier = {"workers": 0, **tier}
    return ServerConfig.from_flat(role="leaf", upstream=upstream, name=name, min_clients=2,
                                  accumulator=accumulator, key=str(keys / f"{name}.key"),
                                  leaf_keys=leaf_keys, **tier)


def leaf_keys(keys: Path, *names: str) -> str:
    """Write an identity key per leaf under ``keys``, and the parent's --leaf-keys file that
    registers ``names``; returns that file's path."""
    keys.mkdir(exist_ok=True)
    lines = []
    for name in names:
        if not (keys / f"{name}.key").exists():
            NodeKey.from_seed(name).save(keys / f"{name}.key")
        lines.append((keys / f"{name}.key.pub").read_text())
    registry = keys / ("registry-" + "-".join(names) + ".txt")
    registry.write_text("".join(lines))
    return str(registry)


def flat_run(accumulator: str) -> np.ndarray:
    core = build_core(top_config(accumulator, 4), TASK, out_dir=None, evaluate=False)
    with ServerThread(core, "127.0.0.1:0") as top:
        threads = run_clients([top.address] * 4)
        assert top.wait_done(timeout=120)
        params = top.call(lambda: core.params.copy())
        for th in threads:  # they leave when the server says stop
            th.join(30)
    return params


def hierarchical_run(accumulator: str, keys: Path, **leaf_tier: object
                     ) -> tuple[np.ndarray, dict]:
    core = build_core(top_config(accumulator, 1, leaf_keys(keys, "middle")), TASK, out_dir=None,
                      evaluate=False)
    servers: list[ServerThread] = []
    try:
        top = ServerThread(core, "127.0.0.1:0").start()
        servers.append(top)
        middle = ServerThread(Leaf(leaf_config(top.address, "middle", accumulator, keys,
                                               leaf_keys(keys, "leaf-a", "leaf-b")), TASK))
        servers.append(middle.start())
        leaves = [ServerThread(Leaf(leaf_config(middle.address, f"leaf-{x}", accumulator, keys,
                                                **leaf_tier), TASK))
                  for x in "ab"]
        for leaf in leaves:
            servers.append(leaf.start())
        threads = run_clients([leaves[0].address] * 2 + [leaves[1].address] * 2)
        assert top.wait_done(timeout=120)
        params = top.call(lambda: core.params.copy())
        metrics = top.call(lambda: dict(core.last_metrics))
        metrics["leaf_worker_folds"] = sum(
            leaf.call(lambda leaf=leaf: leaf.server.core.folds.folded
                      if leaf.server.core.folds is not None else 0) for leaf in leaves)
        for th in threads:
            th.join(30)
    finally:
        for srv in reversed(servers):
            srv.stop(grace=None)
    return params, metrics


def test_three_levels_give_the_flat_run_s_model_bit_for_bit_with_exact_sums(tmp_path) -> None:
    flat = flat_run("exact")
    tree, metrics = hierarchical_run("exact", tmp_path)
    assert metrics["version"] == VERSIONS and metrics["updates_in_version"] == 4
    assert np.array_equal(flat, tree)


def test_leaves_that_fold_in_their_workers_forward_the_same_partials(tmp_path) -> None:
    """The bottom leaves fold their clients' updates in worker processes (server/folds.py):
    the partials they forward give the flat run's model bit for bit (exact sums)."""
    flat = flat_run("exact")
    tree, metrics = hierarchical_run("exact", tmp_path, workers=2, worker_folds="on")
    assert metrics["version"] == VERSIONS
    assert metrics["leaf_worker_folds"] == 4 * VERSIONS
    assert np.array_equal(flat, tree)


def test_three_levels_match_the_flat_run_to_float32_rounding(tmp_path) -> None:
    flat = flat_run("float32")
    tree, _ = hierarchical_run("float32", tmp_path)
    np.testing.assert_allclose(tree, flat, rtol=1e-5, atol=1e-7)


# -- bad partial aggregates: refused like a bad client push, model unchanged -----------------


@pytest.fixture
def top():
    core = build_core(ServerConfig.from_flat(mode="async", buffer_size=1, min_clients=1,
                                             max_versions=5, require_identity=False,
                                             workers=0), TASK, out_dir=None, evaluate=False)
    with ServerThread(core, "127.0.0.1:0") as srv:
        yield srv


def _push_partial(t: GrpcTransport, session: str, payload: bytes, *, base_version: int = 0,
                  fingerprint: str = TASK_FINGERPRINT) -> object:
    return t.push(UpdateHeader(session=session, update_id=uuid.uuid4().hex[:12],
                               base_version=base_version, round=0, num_examples=4,
                               codec="partial", payload_bytes=len(payload),
                               spec_fingerprint=fingerprint), payload)


def test_bad_partials_are_refused_and_the_model_is_unchanged(top) -> None:
    size = top.core.spec.size
    before = top.call(lambda: top.core.params.copy())
    t = GrpcTransport(top.address, timeout_s=10)
    s = t.join("leaf-x", DeviceProfile())[0].session
    ok = np.full(size, 0.5, np.float32)
    # encode_partial refuses NaN itself, so a hostile leaf's payload is patched by hand: the
    # float32 sum starts after the 24-byte header
    nan = bytearray(encode_partial(weight=4.0, count=2, sum_f32=ok))
    nan[24 + 12:24 + 16] = np.array([np.nan], "<f4").tobytes()
    zero_weight = bytearray(encode_partial(weight=4.0, count=2, sum_f32=ok))
    zero_weight[8:16] = np.array([0.0], "<f8").tobytes()
    cases = {
        "wrong size": (encode_partial(weight=4.0, count=2, sum_f32=ok[:-1]), 0),
        "non-finite": (bytes(nan), 0),
        "zero weight": (bytes(zero_weight), 0),
        "truncated": (encode_partial(weight=4.0, count=2, sum_f32=ok)[:-3], 0),
        "unknown version": (encode_partial(weight=4.0, count=2, sum_f32=ok), 7),
        # the field reports: a tiny weight escaped the fold bound (1e-30 with values 1e8 moved
        # the model by 1e38), 5e-324 was taken and its version dropped, 2**64-1 reached the
        # metrics; a partial weighs at least one example per update it counts
        "tiny weight": (encode_partial(weight=1e-30, count=1, sum_f32=ok * 2e8), 0),
        "denormal weight": (encode_partial(weight=5e-324, count=1, sum_f32=ok), 0),
        "weight below count": (encode_partial(weight=3.0, count=4, sum_f32=ok), 0),
        "huge count": (encode_partial(weight=2.0**64, count=(1 << 64) - 1, sum_f32=ok), 0),
        "weight over its examples": (encode_partial(weight=2.0**45, count=2, sum_f32=ok), 0),
    }
    for name, (payload, version) in cases.items():
        with pytest.raises(RemoteError) as err:
            _push_partial(t, s, payload, base_version=version)
        assert err.value.status == "INVALID_ARGUMENT", name
    assert top.call(lambda: (top.core.version, top.core.traffic.updates)) == (0, 0)
    assert np.array_equal(top.call(lambda: top.core.params.copy()), before)
    # a good partial counts as its updates and moves the model by its mean
    _push_partial(t, s, encode_partial(weight=4.0, count=2, sum_f32=ok))
    version, params = t.pull(s)
    assert version == 1
    np.testing.assert_allclose(params - before, ok / 4.0, rtol=1e-6)
    t.close()


def test_only_registered_leaves_may_push_partials(tmp_path) -> None:
    registry = leaf_keys(tmp_path, "site-a")
    leaf_key = NodeKey.load(tmp_path / "site-a.key")
    core = build_core(ServerConfig.from_flat(mode="async", buffer_size=1, min_clients=1,
                                             max_versions=5, workers=0, leaf_keys=registry),
                      TASK, out_dir=None, evaluate=False)
    partial = encode_partial(weight=4.0, count=2,
                             sum_f32=np.full(core.spec.size, 0.5, np.float32))
    with ServerThread(core, "127.0.0.1:0") as srv:
        t = GrpcTransport(srv.address, timeout_s=10)
        try:
            # a client (any key not registered) is refused, before a payload byte is read
            client = NodeKey.generate()
            s = t.join_as(client, DeviceProfile())[0].session
            header = client.sign_update(UpdateHeader(
                session=s, update_id="p1", base_version=0, num_examples=4, codec="partial",
                payload_bytes=len(partial), spec_fingerprint=TASK_FINGERPRINT),
                payload_digest(partial))
            with pytest.raises(RemoteError) as err:
                t.push(header, partial)
            assert err.value.status == "PERMISSION_DENIED"
            assert "--leaf-keys" in err.value.message
            # a process calling itself a leaf is refused at Join, naming the fix
            with pytest.raises(RemoteError, match="not registered here"):
                t.join_as(NodeKey.generate(), DeviceProfile(device="leaf"))
            assert srv.call(lambda: (core.version, core.traffic.updates)) == (0, 0)
            # the registered leaf's partial counts as its two updates
            s = t.join_as(leaf_key, DeviceProfile(device="leaf"))[0].session
            header = leaf_key.sign_update(dataclasses.replace(header, session=s),
                                          payload_digest(partial))
            assert not t.push(header, partial).duplicate
            assert srv.call(lambda: (core.version, core.traffic.updates)) == (1, 1)
        finally:
            t.close()


def test_leaf_keys_need_identities() -> None:
    with pytest.raises(ValueError, match="leaf_keys needs require_identity"):
        ServerConfig.from_flat(leaf_keys="x.txt", require_identity=False)


def test_non_positive_partial_weight_cannot_even_be_encoded() -> None:
    with pytest.raises(ValueError):
        encode_partial(weight=0.0, count=1, sum_f32=np.zeros(4, np.float32))


def test_a_rule_that_needs_every_update_refuses_partials() -> None:
    core = build_core(ServerConfig.from_flat(defense="median", min_clients=1, workers=0,
                                             require_identity=False), TASK,
                      out_dir=None, evaluate=False)
    with ServerThread(core, "127.0.0.1:0") as srv:
        t = GrpcTransport(srv.address, timeout_s=10)
        s = t.join("leaf-x", DeviceProfile())[0].session
        payload = encode_partial(weight=1.0, count=1,
                                 sum_f32=np.zeros(core.spec.size, np.float32))
        with pytest.raises(RemoteError) as err:
            _push_partial(t, s, payload)
        assert err.value.status == "FAILED_PRECONDITION" and "median" in err.value.message
        t.close()


def test_a_leaf_config_needs_an_upstream_and_a_decomposable_rule() -> None:
    with pytest.raises(ValueError, match="upstream"):
        ServerConfig.from_flat(role="leaf")
    with pytest.raises(ValueError, match="decomposable"):
        ServerConfig.from_flat(role="leaf", upstream="127.0.0.1:1", defense="krum")
    with pytest.raises(ValueError, match="decomposable"):
        ServerConfig.from_flat(accumulator="exact", defense="median")


def test_a_leaf_whose_parent_is_unreachable_says_so() -> None:
    import asyncio

    leaf = Leaf(ServerConfig.from_flat(role="leaf", upstream="127.0.0.1:1", workers=0), TASK,
                connect_timeout_s=1.0)
    with pytest.raises(ValueError, match="cannot reach the parent aggregator at 127.0.0.1:1"):
        asyncio.run(asyncio.wait_for(leaf.start(), 60))
