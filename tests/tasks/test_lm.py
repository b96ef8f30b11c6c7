"""The ``lm`` task: generated corpus, character tokenizer, windows, source partition, GPTs,
per-token evaluation, vectorised training and the CLI runs."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from murmura.client import TorchTrainer
from murmura.protocols import ModelSpec, TaskSettings
from murmura.server.core import evaluator_for
from murmura.simulation.execution import Job, LoopExecutor
from murmura.simulation.vectorised import VectorisedExecutor, _cross_entropy
from murmura.tasks import MODELS, TASK_MODELS, TASKS, TaskConfig, load_task
from murmura.tasks.lm import (
    GPT_SIZES,
    SOURCES,
    CharTokenizer,
    LMTask,
    evaluate_lm,
    generate_corpus,
    gpt,
    gpt_config,
    load_lm_data,
    load_lm_task,
    windows,
)

#: The default corpus's vocabulary: 78 characters and the unknown id (the docstring's table).
VOCAB = 79
SMALL = 3_000  # characters per source for the quick tests


@pytest.fixture(scope="module")
def lm() -> LMTask:
    task = load_task(TaskConfig(task="lm"))
    assert isinstance(task, LMTask)
    return task


@pytest.fixture(scope="module")
def small() -> LMTask:
    return load_lm_task(TaskConfig(task="lm", partition="iid"), chars_per_source=SMALL)


# -- corpus -----------------------------------------------------------------------------------


def test_corpus_is_deterministic_per_seed_and_sized() -> None:
    a, b = generate_corpus(seed=0), generate_corpus(seed=0)
    assert a == b
    assert tuple(a) == SOURCES and len(SOURCES) == 8
    assert all(len(text) == 40_000 for text in a.values())  # 320 KB by default
    other = generate_corpus(seed=1)
    assert all(other[s] != a[s] for s in SOURCES)
    short = generate_corpus(seed=0, chars_per_source=500)
    assert all(short[s] == a[s][:500] for s in SOURCES)  # the same documents, cut earlier
    with pytest.raises(ValueError, match="chars_per_source"):
        generate_corpus(chars_per_source=0)


def test_sources_have_distinct_vocabularies() -> None:
    corpus = generate_corpus(seed=0, chars_per_source=20_000)
    words = {s: set(text.split()) for s, text in corpus.items()}
    for i, s in enumerate(SOURCES):
        for t in SOURCES[i + 1:]:
            overlap = len(words[s] & words[t]) / len(words[s] | words[t])
            assert overlap < 0.35, (s, t, overlap)
    # and variety inside each source: many distinct documents, many distinct words
    for s, text in corpus.items():
        docs = [d for d in text.split("\n\n") if d]
        assert len(set(docs)) > 0.9 * len(docs) and len(words[s]) > 60, s


@pytest.mark.slow
def test_corpus_is_the_same_in_another_process_with_another_hash_seed() -> None:
    code = ("import hashlib, json; from murmura.tasks.lm import generate_corpus; "
            "print(hashlib.sha256(json.dumps(generate_corpus(seed=7)).encode()).hexdigest())")
    here = hashlib.sha256(json.dumps(generate_corpus(seed=7)).encode()).hexdigest()
    for hash_seed in ("1", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert out.stdout.strip() == here


# -- tokenizer and windows ----------------------------------------------------------------------


def test_tokenizer_round_trips_and_maps_unknown_characters_to_zero() -> None:
    text = "".join(generate_corpus(seed=0, chars_per_source=2_000).values())
    tok = CharTokenizer.fit(text)
    ids = tok.encode(text)
    assert ids.dtype == np.int64 and ids.min() >= 1 and ids.max() == tok.vocab_size - 1
    assert tok.decode(ids) == text
    assert tok.chars == "".join(sorted(set(text)))  # sorted: deterministic ids
    assert tok.vocab_size == len(set(text)) + 1
    odd = tok.encode("a\u00e9b\U0001f600")
    assert odd.tolist() == [tok.encode("a")[0], 0, tok.encode("b")[0], 0]
    assert tok.decode(odd) == "a\ufffdb\ufffd"


def test_windows_are_shifted_by_one_token() -> None:
    tokens = np.arange(1, 200, dtype=np.int64)
    x, y = windows(tokens, 16)
    assert x.dtype == np.float32 and y.dtype == np.int64
    assert x.shape == y.shape == ((len(tokens) - 1) // 16, 16)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    np.testing.assert_array_equal(x[1:, 0], y[:-1, -1])  # non-overlapping, contiguous
    np.testing.assert_array_equal(x.astype(np.int64) + 1, y)


def test_task_data_windows_sources_and_held_out_tail(lm) -> None:
    data = lm.data
    assert data is not None and data.tokenizer.vocab_size == VOCAB
    assert lm.train.x.shape == lm.train.y.shape and lm.train.x.shape[1] == 64
    assert lm.train.x.dtype == np.float32 and lm.train.y.dtype == np.int64
    np.testing.assert_array_equal(lm.train.x[:, 1:].astype(np.int64), lm.train.y[:, :-1])
    # every source in both splits; about a tenth of every source's windows held out
    train_n = np.bincount(data.train_source, minlength=8)
    test_n = np.bincount(data.test_source, minlength=8)
    assert (train_n > 0).all() and (test_n > 0).all()
    assert np.allclose(test_n / (train_n + test_n), 0.1, atol=0.02)
    # the test windows are the tail of each source's text: the last 4,000 of 40,000 characters
    corpus = generate_corpus(seed=0)
    for s in (0, 3):
        first = data.tokenizer.decode(lm.test.x[np.argmax(data.test_source == s)].astype(int))
        assert first == corpus[SOURCES[s]][36_000:36_064]


def test_too_little_text_or_a_bad_split_is_refused() -> None:
    with pytest.raises(ValueError, match="no test window"):
        load_lm_data(chars_per_source=300)
    with pytest.raises(ValueError, match="test_fraction"):
        load_lm_data(test_fraction=1.0)


# -- partition ----------------------------------------------------------------------------------


def _mix(task: LMTask, n: int) -> np.ndarray:
    """(client, source) shares of each client's windows."""
    assert task.data is not None
    counts = np.stack([np.bincount(task.data.train_source[s], minlength=8)
                       for s in task.shares(n)])
    return counts / counts.sum(1, keepdims=True)


def test_partition_is_by_source_non_iid_and_deterministic(lm) -> None:
    mix = _mix(lm, 8)  # Dirichlet(0.5) over sources: a main source per client (iid: 1/8)
    assert mix.max(1).mean() > 0.3
    assert len(set(mix.argmax(1).tolist())) >= 4  # and not the same source for everyone
    skewed = _mix(load_task(TaskConfig(task="lm", alpha=0.1)), 8)
    assert skewed.max(1).mean() > 0.6  # smaller alpha: more skew
    again = load_task(TaskConfig(task="lm"))
    assert all(np.array_equal(a, b) for a, b in zip(lm.shares(8), again.shares(8),
                                                     strict=True))
    iid = load_task(TaskConfig(task="lm", partition="iid"))
    assert _mix(iid, 8).max(1).mean() < 0.25  # iid over sources: every client sees all
    one = load_task(TaskConfig(task="lm", partition="shards"))
    assert (_mix(one, 8) > 0.01).sum(1).max() <= 3  # shards: one or two sources each
    covered = np.concatenate(lm.shares(8))
    assert np.array_equal(np.sort(covered), np.arange(len(lm.train)))


def test_client_test_data_follows_the_clients_sources(lm) -> None:
    assert lm.data is not None
    mix = _mix(lm, 8)
    for c in (0, 3):
        test = lm.client_test_data(c, 8)
        assert test is not None and len(test) > 0
        source_of = {r.tobytes(): s for r, s in zip(lm.test.y, lm.data.test_source,
                                                     strict=True)}
        got = np.bincount([source_of[r.tobytes()] for r in test.y], minlength=8) / len(test)
        assert np.abs(got - mix[c]).max() < 0.15
        again = lm.client_test_data(c, 8)
        assert again is not None and np.array_equal(again.y, test.y)


# -- the registry -------------------------------------------------------------------------------


def test_default_model_is_the_tasks_own() -> None:
    assert TaskConfig().model == "mlp"
    assert TaskConfig(task="synthetic").model == "mlp"
    assert TaskConfig(task="lm").model == "gpt1m"
    assert TaskConfig(task="lm", model="gpt10m").model == "gpt10m"
    assert "lm" in TASKS and set(GPT_SIZES) == set(TASK_MODELS["lm"]) <= set(MODELS)


@pytest.mark.parametrize(("task", "model", "valid"), [
    ("lm", "logreg", "gpt1m, gpt10m, gpt100m"), ("digits", "gpt1m", "mlp, logreg")])
def test_a_model_of_another_task_is_refused_in_one_line(task, model, valid) -> None:
    with pytest.raises(ValueError) as err:
        TaskConfig(task=task, model=model)
    text = str(err.value)
    assert "\n" not in text and f"'{model}'" in text and f"'{task}'" in text and valid in text
    with pytest.raises(ValueError, match="unknown model"):
        TaskConfig(task="lm", model="gpt7")


# -- the model ----------------------------------------------------------------------------------


def test_parameter_counts() -> None:
    counts = {"gpt1m": 1_020_032, "gpt10m": 10_732_800, "gpt100m": 99_402_240}
    for name, n in counts.items():
        assert gpt_config(name, VOCAB).num_parameters() == n
    for name in ("gpt1m", "gpt10m"):  # built: the formula counts what exists
        model = gpt(name, VOCAB)
        assert sum(p.numel() for p in model.parameters()) == counts[name]
        assert ModelSpec.from_module(model).size == counts[name]  # no floating buffers


def test_model_shapes_and_causal_mask() -> None:
    torch.manual_seed(0)
    model = gpt("gpt1m", VOCAB, context=32).eval()
    x = torch.randint(1, VOCAB, (3, 32))
    with torch.no_grad():
        logits = model(x.float())
        np.testing.assert_array_equal(logits.numpy(), model(x).numpy())  # float ids = long
        assert logits.shape == (3, VOCAB, 32)
        changed = x.clone()
        changed[:, 20] = (changed[:, 20] % (VOCAB - 1)) + 1
        other = model(changed)
    torch.testing.assert_close(other[:, :, :20], logits[:, :, :20], rtol=0, atol=0)
    assert (other[:, :, 20:] - logits[:, :, 20:]).abs().amax(dim=(0, 1)).min() > 0
    y = torch.randint(1, VOCAB, (3, 32))
    loss = nn.functional.cross_entropy(logits, y)  # the trainers' default loss as it is
    assert loss.shape == () and 3.5 < float(loss) < 5.5
    with pytest.raises(ValueError, match="longer than the context"):
        model(torch.zeros(1, 33))


def test_evaluate_is_per_token(small) -> None:
    model = small.build_model()
    got = evaluate_lm(model, small.test, batch_size=7)
    with torch.no_grad():
        logits = model(torch.from_numpy(small.test.x))
        y = torch.from_numpy(small.test.y)
        loss = float(nn.functional.cross_entropy(logits, y))
        acc = float((logits.argmax(1) == y).float().mean())
    assert set(got) == {"loss", "perplexity", "accuracy"}
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert got["accuracy"] == pytest.approx(acc)
    # the server's evaluator runs the task's evaluate: perplexity reaches its metric rows
    spec = ModelSpec.from_module(model)
    row = evaluator_for(small.model_factory, spec, small.test, small.evaluate)(
        spec.flatten(model))
    assert row["perplexity"] == pytest.approx(got["perplexity"], rel=1e-5)


def test_first_order_training_lowers_perplexity(small, one_torch_thread) -> None:
    model = small.build_model(seed=1)
    before = evaluate_lm(model, small.test)["perplexity"]
    trainer = TorchTrainer(model, small.client_data(0, 2), device="cpu")
    result = trainer.train(trainer.spec.flatten(model),
                           TaskSettings(local_steps=15, batch_size=8, lr=0.1, momentum=0.5),
                           seed=0)
    assert result.params is not None
    trainer.spec.load_into(model, result.params)
    after = evaluate_lm(model, small.test)["perplexity"]
    assert after < 0.6 * before, (before, after)


def test_vectorised_cross_entropy_is_the_trainers_for_positions() -> None:
    torch.manual_seed(0)
    logits, y = torch.randn(5, 11, 7), torch.randint(0, 11, (5, 7))
    per = _cross_entropy(logits, y)
    assert per.shape == (5,)
    torch.testing.assert_close(per.mean(), nn.functional.cross_entropy(logits, y))
    torch.testing.assert_close(per, nn.functional.cross_entropy(logits, y, reduction="none")
                               .mean(1))


def test_vectorised_training_matches_the_trainer(small, one_torch_thread) -> None:
    shares = small.shares(3)
    vec = VectorisedExecutor(small.model_factory, small.train, shares)
    settings = TaskSettings(local_steps=2, batch_size=8, lr=0.1, momentum=0.5)
    assert vec.probe(settings) == "probe matched the trainer"
    params = vec.spec.flatten(small.build_model())
    jobs = [Job(c, params, 10 + c, steps=2 + c) for c in range(3)]  # ragged: some inactive
    got = vec.run(jobs, settings)
    loop = LoopExecutor(small.model_factory, small.train, shares)
    for j, g in zip(jobs, got, strict=True):
        w = loop.run([Job(j.client, j.params, j.seed)],
                     TaskSettings(local_steps=j.steps, batch_size=8, lr=0.1, momentum=0.5))[0]
        assert g.metrics["steps"] == j.steps
        assert not np.array_equal(g.params, params)
        np.testing.assert_allclose(g.params, w.params, atol=1e-5)
        assert g.metrics["train_loss"] == pytest.approx(w.metrics["train_loss"], rel=1e-4)


# -- the commands -------------------------------------------------------------------------------


def _murmura(*argv: str, cwd: Path) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "murmura", *argv, "-q", "--out", "out"],
                          capture_output=True, text=True, timeout=300, cwd=cwd,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "perplexity" in proc.stdout, proc.stdout
    rows = [json.loads(line) for line in (cwd / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["perplexity"]) for r in rows)
    return rows


@pytest.mark.slow
@pytest.mark.integration
def test_murmura_run_lm(tmp_path) -> None:
    rows = _murmura("run", "--task", "lm", "--clients", "4", "--max-versions", "3",
                    "--local-steps", "10", cwd=tmp_path)
    assert rows[-1]["perplexity"] < 50  # from about 80 (uniform over 79 ids)


@pytest.mark.slow
@pytest.mark.integration
def test_murmura_run_lm_zeroth_order_with_seed_codec(tmp_path) -> None:
    rows = _murmura("run", "--task", "lm", "--clients", "4", "--max-versions", "3",
                    "--trainer", "zo", "--codec", "seed", "--local-steps", "50", "--lr", "1e-3",
                    cwd=tmp_path)
    assert rows[-1]["perplexity"] < 75
    assert rows[-1]["bytes_up"] < 20_000  # (seed, scalar) logs, not 4 MB models


@pytest.mark.slow
def test_murmura_simulate_lm(tmp_path) -> None:
    rows = _murmura("simulate", "--task", "lm", "--clients", "20", "--max-versions", "3",
                    "--local-steps", "5", cwd=tmp_path)
    assert rows[-1]["perplexity"] < 50
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["simulation"]["execution"].startswith("vmap")
