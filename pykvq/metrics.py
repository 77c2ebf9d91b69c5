"""Quality metrics from logits: perplexity and KL divergence against a baseline.

Pure numpy. The chunking follows llama-perplexity so numbers are comparable:
the token stream is cut into chunks of n_ctx tokens, each chunk is evaluated
from an empty cache with its first token replaced by BOS (when the model adds
one), and only the second half is scored: logits at positions
first..n_ctx-2 (first = n_ctx // 2) predict tokens first+1..n_ctx-1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def scored_positions(n_ctx: int) -> tuple[int, int]:
    """[first, last) logit positions that llama-perplexity scores in a chunk."""
    first = n_ctx // 2
    return first, n_ctx - 1


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def nll(logprobs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each target token."""
    return -logprobs[np.arange(len(targets)), targets]


def percentile(values: np.ndarray, fraction: float) -> float:
    """Linear-interpolated percentile of llama-perplexity (fraction in [0, 1])."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    if len(v) == 0:
        return float("nan")
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = fraction * (len(v) - 1)
    i = int(p)
    p -= i
    return float((1 - p) * v[i] + p * v[min(i + 1, len(v) - 1)])


@dataclass
class PerplexityResult:
    ppl: float
    n_tokens: int           # scored tokens
    n_chunks: int
    n_ctx: int
    nll: np.ndarray = field(repr=False)

    def __str__(self) -> str:
        return f"PPL {self.ppl:.4f} ({self.n_chunks} chunks of {self.n_ctx}, {self.n_tokens} scored tokens)"


@dataclass
class KLDResult:
    mean_kld: float
    p99_kld: float
    same_top1: float        # fraction of positions with the same argmax token
    ppl: float              # this model's perplexity on the scored tokens
    ppl_base: float         # the baseline's
    n_tokens: int
    n_chunks: int
    n_ctx: int
    kld: np.ndarray = field(repr=False)

    @property
    def median_kld(self) -> float:
        return percentile(self.kld, 0.5)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in
                ("mean_kld", "p99_kld", "same_top1", "ppl", "ppl_base", "n_tokens", "n_chunks", "n_ctx")}

    def __str__(self) -> str:
        return (f"mean KLD {self.mean_kld:.6f}  p99 KLD {self.p99_kld:.6f}  "
                f"same top-1 {100 * self.same_top1:.2f}%  PPL {self.ppl:.4f} (base {self.ppl_base:.4f})  "
                f"[{self.n_chunks} chunks of {self.n_ctx}, {self.n_tokens} tokens]")


class KLDAccumulator:
    """Collects per-token statistics chunk by chunk (bounded memory)."""

    def __init__(self, n_ctx: int):
        self.n_ctx = n_ctx
        self.kld: list[np.ndarray] = []
        self.nll: list[np.ndarray] = []
        self.nll_base: list[np.ndarray] = []
        self.same: list[np.ndarray] = []

    def add(self, base_logprobs: np.ndarray, logits: np.ndarray, targets: np.ndarray,
            base_valid: np.ndarray | None = None) -> None:
        """base_valid masks base probabilities to include (llama-perplexity drops p < e^-16)."""
        lp = log_softmax(logits)
        p = np.exp(base_logprobs)
        terms = p * (base_logprobs - lp)
        if base_valid is not None:
            terms = np.where(base_valid, terms, 0.0)
        self.kld.append(terms.sum(axis=-1))
        self.nll.append(nll(lp, targets))
        self.nll_base.append(nll(base_logprobs, targets))
        self.same.append(np.argmax(logits, axis=-1) == np.argmax(base_logprobs, axis=-1))

    def result(self) -> KLDResult:
        kld = np.concatenate(self.kld)
        return KLDResult(
            mean_kld=float(kld.mean()),
            p99_kld=percentile(kld, 0.99),
            same_top1=float(np.concatenate(self.same).mean()),
            ppl=float(np.exp(np.concatenate(self.nll).mean())),
            ppl_base=float(np.exp(np.concatenate(self.nll_base).mean())),
            n_tokens=int(len(kld)),
            n_chunks=len(self.kld),
            n_ctx=self.n_ctx,
            kld=kld,
        )
