"""The fused Triton step kernel against the CPU replay kernel, bit for bit.

On a machine without a GPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, in
a child process so the compiled path of this process is untouched); on a GPU it runs compiled
and is compared with the CPU kernel on sizes up to 10M values and up to 300 steps. Both tests
skip cleanly where triton (or CUDA) is missing.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from murmura.protocols import prng
from murmura.protocols.codecs import seed as zo
from murmura.protocols.codecs import seed_steps, seed_triton

SIZES = [1, 31, 32, 33, 1000, 16_385, 100_003]

_INTERPRETED = """
import json, sys
import numpy as np, torch
from murmura.protocols import prng
from murmura.protocols.codecs import seed_triton
from murmura.protocols.codecs.seed_steps import _apply_steps_cpu

rng = np.random.default_rng(int(sys.argv[1]))
out = []
for size in json.loads(sys.argv[2]):
    theta = torch.from_numpy(rng.normal(size=size).astype(np.float32))
    seeds = [int(s) for s in rng.integers(0, 2**64, size=6, dtype=np.uint64)]
    coeffs = [float(np.float32(c)) for c in rng.normal(size=6) * 10.0 ** rng.integers(-6, 1)]
    ref = theta.clone()
    _apply_steps_cpu(ref, list(zip(seeds, coeffs)), 1 << 12)
    got = theta.clone()
    seed_triton.apply_steps_cuda(got, [prng.stream_keys(s) for s in seeds], coeffs)
    out.append([size, bool(torch.equal(ref, got)), bool(torch.equal(ref, theta))])
print(json.dumps(out))
"""


def test_the_kernel_in_triton_s_interpreter_matches_the_cpu_kernel() -> None:
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", _INTERPRETED, "7", json.dumps(SIZES)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r[0] for r in rows] == SIZES
    assert all(same for _, same, _ in rows), rows
    assert not any(unchanged for _, _, unchanged in rows)  # and the steps changed theta


def test_without_triton_a_cuda_theta_takes_the_exact_path_and_says_so(monkeypatch,
                                                                       caplog) -> None:
    monkeypatch.setattr(seed_triton, "available", lambda device: False)
    with caplog.at_level(logging.WARNING):
        ready = seed_steps._fused_kernel_ready.__wrapped__(torch.device("cuda", 0))
    assert not ready
    assert "triton is not available" in caplog.text and "pip install triton" in caplog.text


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("size", [*SIZES, (1 << 20) + 7, 10_000_019])
@pytest.mark.parametrize("steps", [1, 7, 300])
def test_the_compiled_kernel_matches_the_cpu_kernel(size: int, steps: int) -> None:
    pytest.importorskip("triton")
    rng = np.random.default_rng([size, steps])
    start = rng.normal(size=size).astype(np.float32)
    seeds = rng.integers(0, 2**64, size=steps, dtype=np.uint64)
    coeffs = zo.step_coefficient(1e-3, rng.normal(size=steps))
    on_cpu = torch.from_numpy(start.copy())
    zo.apply_steps(on_cpu, seeds, coeffs)
    on_gpu = torch.from_numpy(start.copy()).cuda()
    zo.apply_steps(on_gpu, seeds, coeffs)
    assert torch.equal(on_gpu.cpu(), on_cpu)


@pytest.mark.gpu
@needs_cuda
def test_the_compiled_kernel_draws_the_reference_stream() -> None:
    """One step with coefficient 1 on zeros is the stream itself (the slow NumPy oracle)."""
    pytest.importorskip("triton")
    seed, size = 0xDEADBEEF12345, 1_000_037
    theta = torch.zeros(size, device="cuda")
    zo.apply_steps(theta, [seed], [1.0])
    assert np.array_equal(theta.cpu().numpy(), prng.rademacher_reference(seed, size))
