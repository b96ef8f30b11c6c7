"""Shared-memory slabs (server/slabs.py): size classes, recycling, the cap, attaching without
the resource tracker, the remote-output convention, and no segment left in /dev/shm."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import pytest

from murmura.server import slabs
from murmura.server.slabs import (
    MIN_SLAB_BYTES,
    OutArray,
    OutRef,
    SlabRef,
    attach,
    resolve,
    write_out,
)
from tests.server.conftest import SHM, needs_dev_shm, shm_names

MiB = 1 << 20


def test_a_released_slab_is_recycled_for_a_request_of_its_class(make_pool) -> None:
    pool = make_pool()
    first = pool.acquire(3 * MiB)
    assert first is not None and first.size == 4 * MiB and first.nbytes == 3 * MiB
    first.buf[:4] = b"abcd"
    name = first.name
    assert pool.release(first)
    again = pool.acquire(3 * MiB - 100)
    assert again is not None and again.name == name and bytes(again.buf[:4]) == b"abcd"
    assert pool.stats()["created"] == 1 and pool.stats()["reused"] == 1
    other = pool.acquire(5 * MiB)  # another class: a new segment
    assert other is not None and other.size == 8 * MiB and other.name != name


def test_a_zero_byte_slab_works(make_pool) -> None:
    pool = make_pool()
    slab = pool.acquire(0)
    assert slab is not None and slab.nbytes == 0 and slab.size == MIN_SLAB_BYTES
    ref = slab.ref()
    assert ref.nbytes == 0 and bytes(attach(ref)) == b""
    assert resolve(ref).nbytes == 0


def test_the_cap_turns_a_request_into_none_and_changes_nothing(make_pool) -> None:
    pool = make_pool(4 * MiB)
    held = pool.acquire(3 * MiB)  # a 4 MiB class: the whole cap
    assert held is not None and pool.in_use_bytes == 4 * MiB
    before = pool.stats()
    assert pool.acquire(0) is None
    after = pool.stats()
    assert after["refused"] == before["refused"] + 1
    assert {k: v for k, v in after.items() if k != "refused"} == \
        {k: v for k, v in before.items() if k != "refused"}
    pool.release(held)
    assert pool.acquire(1) is not None


def test_a_request_beyond_the_cap_is_an_error_and_a_class_is_capped(make_pool) -> None:
    pool = make_pool(6 * MiB)
    with pytest.raises(ValueError, match="can never fit"):
        pool.acquire(6 * MiB + 1)
    slab = pool.acquire(5 * MiB)  # its class (8 MiB) exceeds the cap: an exact-size slab
    assert slab is not None and slab.size == 5 * MiB
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        pool.acquire(-1)


@needs_dev_shm
def test_idle_slabs_beyond_the_per_class_limit_are_unlinked(make_pool) -> None:
    pool = make_pool(idle_per_class=2)
    lent = [pool.acquire(MiB) for _ in range(3)]
    assert all(s is not None for s in lent)
    names = [s.name for s in lent]  # type: ignore[union-attr]
    assert [pool.release(s) for s in lent] == [True, True, False]  # type: ignore[arg-type]
    present = {p.name for p in SHM.iterdir()}
    assert names[0] in present and names[1] in present and names[2] not in present
    assert pool.stats()["slabs_idle"] == 2 and pool.idle_bytes == 2 * MiB


@needs_dev_shm
@needs_dev_shm
def test_slabs_idle_for_longer_than_the_idle_time_are_given_back(make_pool) -> None:
    pool = make_pool(idle_per_class=8)
    burst = [pool.acquire(1000) for _ in range(4)]
    for slab in burst[:3]:
        pool.release(slab)
    names = {s.name for s in burst}
    assert pool.trim_idle(10.0) == 0  # just released: kept for the next burst
    assert pool.trim_idle(10.0, now=time.monotonic() + 11) == 3
    assert pool.stats()["slabs_idle"] == 0 and pool.idle_bytes == 0
    present = {p.name for p in SHM.iterdir()}
    assert names & present == {burst[3].name}  # the lent one stays
    pool.release(burst[3])
    again = pool.acquire(1000)  # the pool still lends after a trim, reusing what is idle
    assert again is not None and again.name == burst[3].name


def test_idle_and_lent_slabs_together_stay_under_the_cap(make_pool) -> None:
    pool = make_pool(8 * MiB)
    small = pool.acquire(4 * MiB)
    assert small is not None
    pool.release(small)
    assert pool.idle_bytes == 4 * MiB
    big = pool.acquire(8 * MiB)  # needs the whole cap: the idle 4 MiB slab goes
    assert big is not None and pool.idle_bytes == 0
    assert small.name not in {p.name for p in SHM.iterdir()}


def test_chunks_written_at_odd_offsets_land_byte_identical(make_pool) -> None:
    pool = make_pool()
    payload = np.random.default_rng(3).integers(0, 256, 3 * MiB + 5, dtype=np.uint8).tobytes()
    slab = pool.acquire(len(payload))
    cuts = [0, 1, 4, 4097, MiB + 3, 3 * MiB, len(payload)]
    for start, end in zip(cuts, cuts[1:], strict=False):
        slab.write(start, memoryview(payload)[start:end])
    assert bytes(slab.buf[:len(payload)]) == payload
    with pytest.raises(ValueError, match="do not fit"):
        slab.write(slab.size - 2, b"abc")
    pool.release(slab)
    with pytest.raises(ValueError, match="released"):
        slab.write(0, b"a")


def test_release_rules(make_pool) -> None:
    pool, other = make_pool(), make_pool()
    slab = pool.acquire(10)
    foreign = other.acquire(10)
    assert slab is not None and foreign is not None
    with pytest.raises(ValueError, match="not lent by this pool"):
        pool.release(foreign)
    assert pool.release(slab) and not pool.release(slab)  # twice: a no-op
    with pytest.raises(ValueError, match="released"):
        slab.buf  # noqa: B018


def test_refs_are_tiny_picklable_and_checked(make_pool) -> None:
    pool = make_pool()
    slab = pool.acquire(1000)
    assert slab is not None
    ref, out = slab.ref(8, 16), slab.out_ref()
    assert isinstance(out, OutRef) and isinstance(out, SlabRef) and out.nbytes == 1000
    assert pickle.loads(pickle.dumps(ref)) == ref and len(pickle.dumps(ref)) < 200
    assert slab.ref(10).nbytes == 990
    with pytest.raises(ValueError, match="do not fit"):
        slab.ref(slab.size - 4, 8)
    with pytest.raises(ValueError, match=">= 0"):
        SlabRef("x", -1, 4)
    with pytest.raises(ValueError, match="reaches byte"):
        attach(SlabRef(slab.name, slab.size, 1))


def test_attach_in_the_owner_process_sees_the_pool_memory(make_pool) -> None:
    pool = make_pool()
    slab = pool.acquire(64)
    assert slab is not None
    slab.buf[8:12] = b"\x01\x02\x03\x04"
    view = attach(slab.ref(8, 4))
    assert bytes(view) == b"\x01\x02\x03\x04"
    view[0] = 9
    assert slab.buf[8] == 9
    del view


def test_attaching_registers_nothing_with_the_resource_tracker(monkeypatch) -> None:
    # A segment this process does not own through a pool: attach must map it without telling
    # the resource tracker, which would unlink it when an unrelated process exits.
    shm = shared_memory.SharedMemory(create=True, size=4096)
    try:
        shm.buf[:3] = b"xyz"
        registered: list[tuple[str, str]] = []
        monkeypatch.setattr(resource_tracker, "register",
                            lambda name, rtype: registered.append((name, rtype)))
        view = attach(SlabRef(shm.name, 0, 3))
        assert bytes(view) == b"xyz" and registered == []
        del view
    finally:
        monkeypatch.undo()
        slabs.detach_all()
        shm.close()
        shm.unlink()


@needs_dev_shm
def test_an_unlinked_slab_cannot_be_attached_and_close_unlinks_everything(make_pool) -> None:
    pool = make_pool()
    lent, idle = pool.acquire(10), pool.acquire(2 * MiB)
    assert lent is not None and idle is not None
    pool.release(idle)
    prefix = pool.prefix
    assert len(shm_names(prefix)) == 2
    ref = lent.ref()
    pool.close()
    assert shm_names(prefix) == set()
    with pytest.raises(FileNotFoundError):
        attach(ref)
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1)


def test_write_out_writes_locally_and_hands_the_array_back_remotely(make_pool) -> None:
    pool = make_pool()
    slab = pool.acquire(16)
    assert slab is not None
    values = np.arange(4, dtype=np.float32)
    assert write_out(slab.out_ref(), values, "small") == "small"
    assert np.array_equal(np.frombuffer(slab.buf[:16], np.float32), values)
    remote = write_out(None, values, 7)
    assert isinstance(remote, OutArray) and remote.result == 7 and remote.array is values
    with pytest.raises(ValueError, match="does not match"):
        write_out(slab.out_ref(0, 8), values)
    with pytest.raises(TypeError, match="OutRef"):
        write_out(slab.ref(), values)  # type: ignore[arg-type]


def test_resolve_takes_a_ref_or_the_bytes_shipped_in_its_place(make_pool) -> None:
    pool = make_pool()
    slab = pool.acquire(4)
    assert slab is not None
    slab.buf[:4] = b"abcd"
    assert bytes(resolve(slab.ref())) == b"abcd"
    assert bytes(resolve(b"abcd")) == b"abcd"
    assert bytes(resolve(np.frombuffer(b"abcd", np.uint8))) == b"abcd"
    assert resolve(np.zeros(2, np.float32)).nbytes == 8
    with pytest.raises(TypeError, match="SlabRef or a bytes-like"):
        resolve("abcd")  # type: ignore[arg-type]


@needs_dev_shm
@pytest.mark.integration
@pytest.mark.slow
def test_a_process_with_its_own_tracker_attaches_without_unlinking(make_pool) -> None:
    # The CPython bug the attach path avoids: an unrelated process (its own resource tracker)
    # that attached with SharedMemory(name) unlinks the segment when it exits.
    pool = make_pool()
    slab = pool.acquire(5)
    assert slab is not None
    slab.buf[:5] = b"hello"
    ref = slab.ref()
    code = ("import sys; from murmura.server.slabs import SlabRef, attach, detach_all; "
            f"v = attach(SlabRef({ref.name!r}, 0, 5)); sys.stdout.write(bytes(v).decode()); "
            "del v; detach_all()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "default"})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hello"
    assert "leaked" not in done.stderr
    assert ref.name in {p.name for p in SHM.iterdir()}
    assert bytes(slab.buf[:5]) == b"hello"
