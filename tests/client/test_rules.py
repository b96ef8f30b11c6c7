"""The client rules every driver of the client loop shares, and ClientRuntime following them."""

from __future__ import annotations

import re
import uuid

import numpy as np
import pytest

from murmura.client import (
    ClientRuntime,
    UpdateIds,
    after_refusal,
    codec_choice,
    encoder_seed,
    make_encoder,
)
from murmura.client.rules import UPDATE_ID_LENGTH, run_is_over
from murmura.client.transport import RETRYABLE
from murmura.protocols import TaskSettings, UnknownCodecError
from tests.client.core_transport import CoreTransport
from tests.client.test_trainer_runtime import core_for, linear_trainer

URL_SAFE = re.compile(r"^[A-Za-z0-9_-]+$")


def test_the_encoder_seed_is_a_stable_32_bit_function_of_the_client_id() -> None:
    # the formula the runtime has always used: restarted clients keep their codec randomness
    want = int.from_bytes(uuid.uuid5(uuid.NAMESPACE_OID, "client-007").bytes[:4], "big")
    assert encoder_seed("client-007") == want
    seeds = {encoder_seed(f"client-{i:03d}") for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**32 for s in seeds)


def test_the_servers_codec_options_apply_only_to_the_servers_codec() -> None:
    settings = TaskSettings(codec="topk", codec_options={"ratio": "0.1"})
    assert codec_choice(settings) == ("topk", {"ratio": "0.1"})
    assert codec_choice(settings, "topk") == ("topk", {"ratio": "0.1"})
    assert codec_choice(settings, "dense-f16") == ("dense-f16", {})


def test_make_encoder_seeds_from_the_client_id() -> None:
    # Prepare: a codec that draws random bases from the encoder's seed
    settings = TaskSettings(codec="proj", codec_options={"k": "4", "block": "64"})
    update = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    # Execute
    a = make_encoder(settings, 1000, "client-001").encode(update)
    again = make_encoder(settings, 1000, "client-001").encode(update)
    other = make_encoder(settings, 1000, "client-002").encode(update)
    # Assert
    assert a == again and a != other
    with pytest.raises(UnknownCodecError, match="unknown codec 'nope'"):
        make_encoder(settings, 1000, "client-001", "nope")
    with pytest.raises(ValueError, match="spec_size"):
        make_encoder(settings, 0, "client-001")


def test_update_ids_are_12_url_safe_characters_random_or_seeded() -> None:
    random_ids = UpdateIds()
    ids = [random_ids() for _ in range(5000)]
    assert UPDATE_ID_LENGTH == 12
    assert all(len(i) == 12 and URL_SAFE.match(i) for i in ids)
    assert len(set(ids)) == len(ids)
    seeded = [UpdateIds(seed=3)() for _ in range(2)]
    a, b, c = UpdateIds(seed=3), UpdateIds(seed=3), UpdateIds(seed=4)
    run_a = [a() for _ in range(100)]
    assert run_a == [b() for _ in range(100)] != [c() for _ in range(100)]
    assert len(set(run_a)) == 100 and seeded[0] == seeded[1] == run_a[0]
    assert all(len(i) == 12 and URL_SAFE.match(i) for i in run_a)


@pytest.mark.parametrize("status,action", [
    ("UNAUTHENTICATED", "rejoin"),
    *[(s, "retry") for s in sorted(RETRYABLE)],
    ("INVALID_ARGUMENT", "next_task"),
    ("FAILED_PRECONDITION", "next_task"),
    ("RESOURCE_EXHAUSTED", "next_task"),
    ("PERMISSION_DENIED", "next_task"),
])
def test_after_refusal_says_what_a_client_does(status: str, action: str) -> None:
    assert after_refusal(status) == action


def test_the_runtime_names_its_updates_with_its_update_id_source() -> None:
    # Prepare: two runs of one client, each with the same seeded id source
    pushed = []
    for _ in range(2):
        trainer = linear_trainer()
        core = core_for(trainer, mode="async", buffer_size=1, max_versions=3, min_clients=1)
        transport = CoreTransport(core)
        ClientRuntime(transport, trainer, client_id="c1", wait_s=0,
                      update_ids=UpdateIds(seed=9)).run()
        pushed.append([h.update_id for h, _ in transport.pushes])
    # Assert: the ids are the source's, in order
    want = UpdateIds(seed=9)
    assert pushed[0] == pushed[1] == [want() for _ in range(3)]
    # and by default they are random, still 12 characters
    trainer = linear_trainer()
    core = core_for(trainer, mode="async", buffer_size=1, max_versions=2, min_clients=1)
    transport = CoreTransport(core)
    ClientRuntime(transport, trainer, client_id="c1", wait_s=0).run()
    ids = [h.update_id for h, _ in transport.pushes]
    assert len(ids) == 2 and all(len(i) == 12 for i in ids) and set(ids).isdisjoint(pushed[0])


def test_the_runtime_encodes_with_make_encoder() -> None:
    # Prepare: a server asking for a seeded random-projection codec
    trainer = linear_trainer()
    settings = TaskSettings(codec="proj", codec_options={"k": "1", "block": "4"})
    core = core_for(trainer, mode="async", buffer_size=1, max_versions=1, min_clients=1,
                    train=settings)
    transport = CoreTransport(core)
    # Execute
    ClientRuntime(transport, trainer, client_id="c1", wait_s=0).run()
    # Assert: the payload is what make_encoder's encoder makes of the update (+1 everywhere)
    header, payload = transport.pushes[0]
    update = np.ones(trainer.spec.size, np.float32)
    assert header.codec == "proj"
    assert payload == make_encoder(settings, trainer.spec.size, "c1").encode(update)
    assert payload != make_encoder(settings, trainer.spec.size, "c2").encode(update)


def test_an_update_refused_because_the_run_is_over_is_no_warning(caplog) -> None:
    # Prepare: a joined client, then the run ends (an async run's last updates arrive late)
    trainer = linear_trainer()
    core = core_for(trainer, mode="async", buffer_size=1, max_versions=3, min_clients=1)
    runtime = ClientRuntime(CoreTransport(core), trainer, client_id="c1", wait_s=0)
    runtime._call(runtime._join)
    core.stop()
    # Execute: its update arrives after the end
    with caplog.at_level("INFO", logger="murmura.client.runtime"):
        runtime.step(1, seed=1)
    # Assert: refused and counted, logged at INFO only, and the rule says why
    assert runtime.stats.refused == 1 and runtime.stats.refusals == ["FAILED_PRECONDITION"]
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert "the run is over" in caplog.text
    assert run_is_over("FAILED_PRECONDITION", core._finished_message())
    assert not run_is_over("FAILED_PRECONDITION", "base version 7 is in the future")
