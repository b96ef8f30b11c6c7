"""Seed-based zeroth-order training: exact replay through the real core, learning, memory."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from murmura.client import ClientRuntime, TorchTrainer
from murmura.client.zo import SettingsTrainer, ZOTrainer, bind_flat, make_trainer
from murmura.protocols import ModelSpec, TaskSettings, create_codec
from murmura.protocols.codecs.seed import SeedCodec, replay
from murmura.server import AggregatorCore, ServerConfig
from murmura.tasks import ArrayDataset, evaluate
from tests.client.core_transport import CoreTransport, drive

RecordingTransport = CoreTransport

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cfg(**kw) -> ServerConfig:
    """A config for legacy (unsigned) client ids; tests/security covers identities."""
    return ServerConfig.from_flat(require_identity=False, **kw)


def sha256(vector: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(vector, dtype=np.float32).tobytes()).hexdigest()


def zo_settings(**overrides: object) -> TaskSettings:
    base = dict(trainer="zo", codec="seed", local_epochs=0, local_steps=40, batch_size=32,
                lr=1e-3, zo_eps=1e-3)
    base.update(overrides)
    return TaskSettings(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("options", [{}, {"dtype": "int8"}, {"seed_bits": "64"}, {"q": "3"}])
def test_server_replay_reproduces_the_client_model(digits, options: dict[str, str]) -> None:
    # Prepare: one ZO client against the real core, which applies every update at once
    settings = zo_settings(codec_options=options)
    trainer = ZOTrainer(digits.build_model(seed=1), digits.client_data(0, 4), device="cpu")
    start = trainer.spec.flatten(trainer.model)
    core = AggregatorCore(_cfg(mode="async", buffer_size=1, min_clients=1,
                                       max_versions=1, optimizer="fedavg", server_lr=1.0,
                                       train=settings), trainer.spec, start)
    transport = RecordingTransport(core)
    runtime = ClientRuntime(transport, trainer, client_id="zo-client", wait_s=0)

    # Execute
    stats = runtime.run()

    # Assert: the codec's replay of the wire payload is the client's model, bit for bit ...
    assert stats.pushed == 1 and core.version == 1
    (header, payload), = transport.pushes
    assert header.codec == "seed" and header.payload_bytes == len(payload)
    codec = create_codec("seed", options)
    assert isinstance(codec, SeedCodec)
    assert len(payload) == codec.payload_bytes(settings.local_steps * codec.q)
    client_model = trainer.spec.flatten(trainer.model)
    assert sha256(replay(start, codec.unpack(payload))) == sha256(client_model)
    assert sha256(client_model) != sha256(start)
    # ... and the server's new global model is reference + (replay - reference) up to rounding
    np.testing.assert_allclose(core.params, client_model, rtol=0, atol=1e-6)


def test_zo_training_is_seeded_and_never_touches_its_input(digits) -> None:
    trainer = ZOTrainer(digits.build_model(), digits.client_data(1, 4), device="cpu")
    start = trainer.spec.flatten(trainer.model)
    frozen = start.copy()
    a = trainer.train(start, zo_settings(), seed=7)
    b = trainer.train(start, zo_settings(), seed=7)
    c = trainer.train(start, zo_settings(), seed=8)
    assert a.encoded == b.encoded != c.encoded
    assert a.params is not None and a.params.tobytes() == b.params.tobytes()
    assert start.tobytes() == frozen.tobytes()
    assert a.metrics["steps"] == 40 and "zo_skipped" not in a.metrics
    assert a.num_examples == len(digits.client_data(1, 4))


def test_zo_with_another_server_codec_sends_default_seed_updates(digits) -> None:
    # The server decodes a 'seed' push with default options when its codec is something else.
    settings = zo_settings(codec="int8", codec_options={"block": "64"})
    trainer = ZOTrainer(digits.build_model(), digits.client_data(2, 4), device="cpu",
                        return_params=False)
    start = trainer.spec.flatten(trainer.model)
    core = AggregatorCore(_cfg(mode="async", buffer_size=1, min_clients=1,
                                       max_versions=1, train=settings), trainer.spec, start)
    transport = RecordingTransport(core)
    ClientRuntime(transport, trainer, client_id="c", wait_s=0).run()
    (header, payload), = transport.pushes
    assert header.codec == "seed" and core.version == 1
    assert len(payload) == create_codec("seed").payload_bytes(settings.local_steps)
    np.testing.assert_allclose(core.params, trainer.spec.flatten(trainer.model), atol=1e-6)


def test_too_many_steps_for_the_codec_are_refused_before_training(digits) -> None:
    trainer = ZOTrainer(digits.build_model(), digits.client_data(0, 4), device="cpu")
    start = trainer.spec.flatten(trainer.model)
    with pytest.raises(ValueError, match="max_steps"):
        trainer.train(start, zo_settings(codec_options={"max_steps": "10"}), seed=0)
    with pytest.raises(ValueError, match="q=8 perturbations exceed"):  # 40 steps x 8 > 300
        trainer.train(start, zo_settings(codec_options={"max_steps": "300", "q": "8"}), seed=0)


def test_q_directions_per_batch_average_their_estimates(digits) -> None:
    """q > 1 (n-SPSA): q log entries per batch, each carrying g/q, and the model still matches
    the log's replay exactly."""
    trainer = ZOTrainer(digits.build_model(), digits.client_data(0, 4), device="cpu")
    start = trainer.spec.flatten(trainer.model)
    one = trainer.train(start, zo_settings(local_steps=10), seed=3)
    four = trainer.train(start, zo_settings(local_steps=10, codec_options={"q": "4"}), seed=3)
    codec = create_codec("seed", {"q": "4"})
    assert isinstance(codec, SeedCodec) and codec.q == 4
    steps = codec.unpack(four.encoded[1])
    assert len(steps) == 40 and four.metrics["steps"] == 10
    assert np.abs(steps.grads).mean() < np.abs(codec.unpack(one.encoded[1]).grads).mean()
    assert sha256(replay(start, steps)) == sha256(four.params)
    with pytest.raises(ValueError, match="q"):
        create_codec("seed", {"q": "0"})


def test_federated_zo_on_digits_beats_the_initial_model(digits) -> None:
    # Prepare: four ZO clients, synchronous rounds over the real core
    settings = zo_settings(local_steps=150, lr=8e-3)
    model = digits.build_model(seed=0)
    spec = ModelSpec.from_module(model)
    start = spec.flatten(model)
    before = evaluate(model, digits.test)
    core = AggregatorCore(_cfg(mode="sync", min_clients=4, max_versions=6,
                                       train=settings), spec, start)
    runtimes = [ClientRuntime(RecordingTransport(core),
                              ZOTrainer(digits.build_model(), digits.client_data(i, 4),
                                        device="cpu", return_params=False),
                              client_id=f"client-{i}", wait_s=0) for i in range(4)]

    # Execute: drive the rounds from one thread
    drive(core, runtimes)

    # Assert
    spec.load_into(model, core.params)
    after = evaluate(model, digits.test)
    assert core.version == 6
    assert after["loss"] < before["loss"] - 0.5
    assert after["accuracy"] > before["accuracy"] + 0.3
    uplink = [len(p) for rt in runtimes for _, p in rt.transport.pushes]  # type: ignore[attr-defined]
    assert max(uplink) == create_codec("seed").payload_bytes(150) < 4096


def _peak_torch_bytes(fn) -> int:
    """Peak bytes of torch CPU allocations alive during ``fn()`` beyond those before it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


def test_zo_keeps_one_copy_of_the_model_and_first_order_needs_more() -> None:
    # Prepare: a 4 M-parameter layer (16 MB), a small batch
    torch.manual_seed(0)
    data = ArrayDataset(np.random.default_rng(0).normal(size=(64, 2000)).astype(np.float32),
                        np.random.default_rng(1).integers(0, 10, 64))
    zo = ZOTrainer(torch.nn.Sequential(torch.nn.Linear(2000, 2000), torch.nn.ReLU(),
                                       torch.nn.Linear(2000, 10)),
                   data, device="cpu", return_params=False)
    sgd = TorchTrainer(torch.nn.Sequential(torch.nn.Linear(2000, 2000), torch.nn.ReLU(),
                                           torch.nn.Linear(2000, 10)), data, device="cpu")
    start = zo.spec.flatten(zo.model)
    model_bytes = zo.spec.nbytes
    settings = zo_settings(local_steps=2, batch_size=8)

    # Execute
    zo_peak = _peak_torch_bytes(lambda: zo.train(start, settings, seed=0))
    sgd_peak = _peak_torch_bytes(lambda: sgd.train(start, settings, seed=0))

    # Assert: the module's tensors are views of theta (one copy), ZO allocates at most a block
    # of z and some activations, first-order allocates gradients and momentum
    base = zo.theta.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in zo.model.parameters())
    assert zo_peak < 0.25 * model_bytes
    assert sgd_peak >= 2 * model_bytes


def test_bind_flat_refuses_tied_weights() -> None:
    a = torch.nn.Linear(3, 3, bias=False)
    model = torch.nn.Sequential(a, torch.nn.Linear(3, 3, bias=False))
    model[1].weight = a.weight
    with pytest.raises(ValueError, match="tied"):
        bind_flat(model, ModelSpec.from_module(model), torch.device("cpu"))


def test_settings_trainer_follows_the_server_settings(digits) -> None:
    trainer = make_trainer(digits.build_model(), digits.client_data(0, 4), device="cpu")
    assert isinstance(trainer, SettingsTrainer)
    start = trainer.spec.flatten(trainer.model)
    sgd = trainer.train(start, TaskSettings(local_epochs=1), seed=0)
    zo = trainer.train(start, zo_settings(local_steps=5), seed=0)
    assert sgd.encoded is None and sgd.params is not None
    assert zo.encoded is not None and zo.encoded[0] == "seed" and zo.params is None
    assert trainer.zeroth_order.model is trainer.first_order.model


def test_zo_trainer_refuses_empty_data() -> None:
    trainer = ZOTrainer(torch.nn.Linear(2, 2), [], device="cpu", num_examples=1)
    start = trainer.spec.flatten(trainer.model)
    with pytest.raises(ValueError, match="no batch"):
        trainer.train(start, zo_settings(local_steps=3), seed=0)


def test_a_client_too_small_for_backprop_trains_zeroth_order_under_an_sgd_server(digits) -> None:
    # Prepare: a first-order server (int8 updates); four clients, two of which (as
    # `murmura client --trainer auto` does when no backward pass fits) train zeroth-order
    settings = TaskSettings(local_epochs=0, local_steps=150, batch_size=32, lr=0.1,
                            momentum=0.5, codec="int8")
    model = digits.build_model(seed=0)
    spec = ModelSpec.from_module(model)
    start = spec.flatten(model)
    core = AggregatorCore(_cfg(mode="sync", min_clients=4, max_versions=4, train=settings),
                          spec, start)
    trainers = [make_trainer(digits.build_model(), digits.client_data(i, 4), device="cpu")
                for i in range(4)]
    for t in trainers[2:]:
        t.train_zeroth_order_only(8e-3)
    runtimes = [ClientRuntime(RecordingTransport(core), t, client_id=f"client-{i}", wait_s=0)
                for i, t in enumerate(trainers)]

    # Execute
    drive(core, runtimes)

    # Assert: every update was taken, in the server's codec; the fallback is deterministic
    assert core.version == 4
    for rt in runtimes:
        pushes = rt.transport.pushes  # type: ignore[attr-defined]
        assert len(pushes) == 4 and {h.codec for h, _ in pushes} == {"int8"}
    r1 = trainers[2].train(start, settings, seed=3)
    r2 = trainers[2].train(start, settings, seed=3)
    assert r1.encoded is None and r1.metrics["zo_fallback"] == 1.0
    np.testing.assert_array_equal(r1.params, r2.params)
    assert not np.array_equal(r1.params, start)
    assert trainers[2].train(start, zo_settings(local_steps=5), seed=0).encoded is not None
    with pytest.raises(ValueError, match="positive"):
        trainers[0].train_zeroth_order_only(0.0)


def test_client_config_checks_the_trainer_choice() -> None:
    from murmura.client.config import ClientConfig

    assert ClientConfig().trainer == "auto"
    with pytest.raises(ValueError, match="trainer must be one of"):
        ClientConfig(trainer="adam")
    with pytest.raises(ValueError, match="zo_lr"):
        ClientConfig(zo_lr=-1.0)


def test_a_model_too_large_for_the_device_is_a_one_line_error() -> None:
    from murmura.client.zo import check_fits, model_bytes

    model = torch.nn.Linear(1000, 1000)
    assert model_bytes(model) == 4 * (1000 * 1000 + 1000)
    check_fits(model_bytes(model), torch.device("cuda", 0), 10 * model_bytes(model))
    with pytest.raises(ValueError, match=r"does not fit on cuda:0 .* GB free") as err:
        check_fits(model_bytes(model), torch.device("cuda", 0), model_bytes(model))
    assert "\n" not in str(err.value)


def test_cuda_graph_is_a_no_op_on_the_cpu(digits) -> None:
    plain = ZOTrainer(digits.build_model(), digits.client_data(0, 4), device="cpu")
    graphed = ZOTrainer(digits.build_model(), digits.client_data(0, 4), device="cpu",
                        cuda_graph=True)
    start = plain.spec.flatten(plain.model)
    a = plain.train(start, zo_settings(local_steps=5), seed=3)
    b = graphed.train(start, zo_settings(local_steps=5), seed=3)
    assert a.encoded == b.encoded and graphed._graphs is None
