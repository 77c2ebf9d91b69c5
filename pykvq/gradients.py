"""The loss's gradients w.r.t. pre-RoPE K and V, per layer and token: their result type and calibration windows.

    g = RuntimeGradients.load(path, n_seq, seq_len)
    g.k[il]   # float32 [n_seq * seq_len, n_head_kv, head_dim], the GGUF's channel order (as pykvq.calibrate's)

convert/layer_gradients.py computes them from a GGUF a layer at a time in float32; the squares are the diagonal
Fisher that codebooks and --kv-bits budgets weigh cache errors with. The windows are pykvq.calibrate.collect's (a
BOS first where the model wants one), so the gradients line up token for token with its samples; each window's
last label is the text's next token.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .calibrate import windows


@dataclass
class RuntimeGradients:
    k: list[np.ndarray]             # per layer float32 [T, n_head_kv, head_dim]
    v: list[np.ndarray]
    n_seq: int
    seq_len: int
    loss: float                     # mean next-token loss over the windows (nats)
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.n_seq * self.seq_len / self.seconds if self.seconds > 0 else 0.0

    def save(self, path: str | os.PathLike) -> None:
        """An npz written through a temporary name (a cache entry is whole or absent)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, n_layer=len(self.k), loss=self.loss, seconds=self.seconds,
                 **{f"k{i}": a for i, a in enumerate(self.k)}, **{f"v{i}": a for i, a in enumerate(self.v)})
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | os.PathLike, n_seq: int, seq_len: int) -> "RuntimeGradients":
        z = np.load(path)
        n = int(z["n_layer"])
        return cls([z[f"k{i}"] for i in range(n)], [z[f"v{i}"] for i in range(n)], n_seq, seq_len,
                   float(z["loss"]), float(z["seconds"]))


def token_windows(tokens: list[int], n_seq: int, seq_len: int, bos: int | None) -> list[tuple[list, list]]:
    """(inputs, labels) of n_seq windows of seq_len: calibrate.collect's windows (BOS first when bos is not None),
    each label the next token of the text."""
    body = seq_len - 1 if bos is not None else seq_len
    out = []
    for w in windows(tokens, n_seq, body + 1):
        w = list(w)
        inp = ([bos] if bos is not None else []) + w[:body]
        out.append((inp, inp[1:] + [w[body]]))
    return out
