"""The ``lm`` task: next-character language modelling on a generated corpus, with small GPTs.

The corpus, its tokenizer and the windows are :mod:`murmura.tasks.corpus`.

The models. :class:`GPT` is a small decoder-only transformer: token and learned position
embeddings, pre-LayerNorm blocks of causal self-attention (plain matmuls and a mask, no fused
attention kernel, so ``torch.func.vmap``/``functional_call`` and the simulator's vectorised
training run it) and a GELU MLP, a final LayerNorm and an untied output head (the vectorised
executor and the zeroth-order trainer both refuse tied weights). It takes ``x`` of shape
``(B, T)`` (float or integer ids) and returns logits of shape ``(B, V, T)``, so
``torch.nn.functional.cross_entropy(logits, y)``, the trainers' default loss, is the mean
per-token cross-entropy. Named sizes (``--model``), parameter counts with the default corpus's
vocabulary (V = 79: 78 characters and the unknown id) and context 64:

=========  =======  ======  =====  ============
name       d_model  layers  heads  parameters
=========  =======  ======  =====  ============
gpt1m      128      5       4      1,020,032
gpt10m     384      6       6      10,732,800
gpt100m    768      14      12     99,402,240
=========  =======  ======  =====  ============

In general ``2*V*d + T*d + L*(12*d*d + 13*d) + 2*d`` (embeddings and head, positions, blocks,
final LayerNorm; the head has no bias).

Evaluation (:func:`evaluate_lm`) reports per-token ``loss`` (mean cross-entropy, nats),
``perplexity`` (its exponential) and next-token ``accuracy``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from murmura.tasks.corpus import (
    CHARS_PER_SOURCE,
    CONTEXT,
    SOURCES,
    TEST_FRACTION,
    CharTokenizer,
    LMData,
    generate_corpus,
    load_lm_data,
    windows,
)
from murmura.tasks.data import ArrayDataset
from murmura.tasks.registry import Task, TaskConfig


@dataclass(frozen=True)
class GPTConfig:
    """A decoder's shape. ``context`` is the longest input (position embeddings)."""

    vocab_size: int
    context: int = CONTEXT
    d_model: int = 128
    n_layers: int = 5
    n_heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.context, self.d_model, self.n_layers, self.n_heads,
               self.mlp_ratio) < 1:
            raise ValueError(f"every GPTConfig size must be >= 1: {self}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads "
                             f"{self.n_heads}")

    def num_parameters(self) -> int:
        v, t, d, n, f = (self.vocab_size, self.context, self.d_model, self.n_layers,
                         self.mlp_ratio)
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (f * d * d + f * d) + (f * d * d + d)
        return 2 * v * d + t * d + n * block + 2 * d


#: Named sizes: (d_model, n_layers, n_heads).
GPT_SIZES: dict[str, tuple[int, int, int]] = {
    "gpt1m": (128, 5, 4),
    "gpt10m": (384, 6, 6),
    "gpt100m": (768, 14, 12),
}


def gpt_config(name: str, vocab_size: int, context: int = CONTEXT) -> GPTConfig:
    if name not in GPT_SIZES:
        raise ValueError(f"unknown GPT size {name!r}; available: {', '.join(GPT_SIZES)}")
    d, n, h = GPT_SIZES[name]
    return GPTConfig(vocab_size, context, d, n, h)


class CausalSelfAttention(nn.Module):
    """Multi-head attention over earlier positions only, with plain matmuls (vmap-safe)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        heads, hd = self.n_heads, d // self.n_heads
        q, k, v = (z.reshape(b, t, heads, hd).transpose(1, 2)
                   for z in self.qkv(h).split(d, dim=-1))                 # (b, heads, t, hd)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        future = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)


class Block(nn.Module):
    """Pre-LayerNorm: ``h + attn(ln(h))``, then ``h + mlp(ln(h))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, cfg.n_heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.out(nn.functional.gelu(self.fc(self.ln2(h))))


class GPT(nn.Module):
    """A decoder-only transformer: ``(B, T)`` token ids in, ``(B, V, T)`` logits out."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2's: N(0, 0.02) weights, zero biases, residual outputs scaled by 1/sqrt(2 L)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.modules():
            if isinstance(block, Block):
                for linear in (block.attn.proj, block.out):
                    nn.init.normal_(linear.weight, std=0.02 / math.sqrt(2 * self.config.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x.long()  # float32 ids from an ArrayDataset are exact integers
        t = ids.shape[-1]
        if t > self.config.context:
            raise ValueError(f"input of {t} tokens is longer than the context "
                             f"{self.config.context}")
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h)).transpose(-2, -1)  # (B, V, T): cross_entropy's layout


def gpt(name: str, vocab_size: int, context: int = CONTEXT) -> GPT:
    """The named size (:data:`GPT_SIZES`) for a vocabulary and context."""
    return GPT(gpt_config(name, vocab_size, context))


# -- evaluation and the task --------------------------------------------------------------------


@torch.no_grad()
def evaluate_lm(model: nn.Module, data: ArrayDataset, *, batch_size: int = 256
                ) -> dict[str, float]:
    """Per-token mean cross-entropy (``loss``), ``perplexity`` = exp(loss) and next-token
    ``accuracy`` of ``model`` on windows ``data``."""
    model.eval()
    device = next(model.parameters()).device
    loss_sum, correct, tokens = 0.0, 0, 0
    for start in range(0, len(data), batch_size):
        x = torch.from_numpy(data.x[start:start + batch_size]).to(device)
        y = torch.from_numpy(data.y[start:start + batch_size]).to(device)
        logits = model(x).float()
        loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
        tokens += y.numel()
    loss = loss_sum / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "accuracy": correct / max(tokens, 1)}


@dataclass
class LMTask(Task):
    """The ``lm`` task: shares are drawn over the windows' sources (see the module doc)."""

    data: LMData | None = field(default=None, repr=False)

    def _lm(self) -> LMData:
        assert self.data is not None
        return self.data

    def partition_labels(self) -> npt.NDArray[np.int64]:
        return self._lm().train_source

    def client_test_data(self, index: int, num_clients: int) -> ArrayDataset | None:
        """Held-out windows in the proportions of sources of the client's training share
        (about one test window per nine training ones), sampled with the data seed."""
        lm = self._lm()
        share = self.shares(num_clients)[index]
        counts = np.bincount(lm.train_source[share], minlength=len(lm.sources))
        want = max(1, round(len(share) * TEST_FRACTION / (1 - TEST_FRACTION)))
        quota = np.floor(counts / max(counts.sum(), 1) * want).astype(np.int64)
        rest = counts / max(counts.sum(), 1) * want - quota
        quota[np.argsort(-rest, kind="stable")[:want - int(quota.sum())]] += 1
        rng = np.random.default_rng([self.config.data_seed, index, num_clients])
        picked = []
        for s, k in enumerate(quota.tolist()):
            pool = np.flatnonzero(lm.test_source == s)
            if k and len(pool):
                picked.append(rng.choice(pool, size=min(k, len(pool)), replace=False))
        if not picked:
            return None
        return self.test.subset(np.sort(np.concatenate(picked)))

    def evaluate(self, model: nn.Module, data: ArrayDataset) -> dict[str, float]:
        return evaluate_lm(model, data)


def load_lm_task(cfg: TaskConfig, *, chars_per_source: int = CHARS_PER_SOURCE,
                 context: int = CONTEXT) -> LMTask:
    """The ``lm`` task for ``cfg`` (its ``model`` one of :data:`GPT_SIZES`)."""
    lm = load_lm_data(seed=cfg.data_seed, chars_per_source=chars_per_source, context=context)
    factory = partial(gpt, cfg.model, lm.tokenizer.vocab_size, context)
    return LMTask(cfg, lm.train, lm.test, factory, data=lm)


__all__ = ["CHARS_PER_SOURCE", "CONTEXT", "GPT", "GPT_SIZES", "SOURCES", "TEST_FRACTION",
           "CharTokenizer", "GPTConfig", "LMData", "LMTask", "evaluate_lm", "generate_corpus",
           "gpt", "gpt_config", "load_lm_data", "load_lm_task", "windows"]
