"""Attention geometry of a GGUF, and where each rotary pair lives in a head.

Pairs are numbered by frequency: pair j (j < n_rot/2) rotates at
freq_base^(-2j/n_rot). In the NORM layout (llama's GGUF order) pair j is head
channels (2j, 2j+1); in the NEOX layout (qwen2 and others) it is (j, j + n_rot/2).
Channels past n_rot are not rotated; they form pairs (n_rot + 2i, n_rot + 2i + 1)
in both layouts. Calibration statistics are kept per pair, so they do not
depend on the layout of the file they are applied to.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pykvq.keys import Keys, Values

from .gguf_io import ConvertError, GGUFModel

SUPPORTED_ARCHS = {"llama": "norm", "qwen2": "neox"}    # arch -> rope layout of its GGUFs


@dataclass(frozen=True)
class Geometry:
    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    freq_base: float
    layout: str                     # "norm" or "neox": where pair j lives now
    rope_freqs: np.ndarray | None   # model-level frequency divisors [n_rot/2] (llama3), or None

    @property
    def group(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def n_pairs(self) -> int:
        return self.head_dim // 2

    @property
    def n_rot_pairs(self) -> int:
        return self.n_rot // 2

    def with_layout(self, layout: str) -> "Geometry":
        return Geometry(**{**self.__dict__, "layout": layout})


def _scalar(v, what: str) -> int:
    if isinstance(v, (list, tuple, np.ndarray)):
        vals = set(int(x) for x in v)
        if len(vals) != 1:
            raise ConvertError(f"per-layer {what} ({sorted(vals)}) is not supported by the converter")
        return vals.pop()
    return int(v)


def geometry(m: GGUFModel, layout: str | None = None) -> Geometry:
    """The file's attention geometry. layout: the rope layout of an architecture outside SUPPORTED_ARCHS, as
    the runtime's graph rotates it (pykvq.calibrate reads it from the ROPE nodes); None refuses such an arch."""
    arch = m.arch
    if arch not in SUPPORTED_ARCHS and layout is None:
        raise ConvertError(f"architecture {arch!r} is not supported; the converter handles "
                           f"{', '.join(SUPPORTED_ARCHS)} (llama covers Mistral and SmolLM), and any architecture "
                           "for --prerope-k without weight transforms (cache types, codebooks, --kv-bits: calibrated and "
                           "priced in the runtime)")
    n_head = _scalar(m.arch_meta("attention.head_count"), "head counts")
    n_head_kv = _scalar(m.arch_meta("attention.head_count_kv", n_head), "KV head counts")
    n_embd = int(m.arch_meta("embedding_length"))
    head_dim = int(m.arch_meta("attention.key_length", n_embd // n_head))
    if int(m.arch_meta("attention.value_length", head_dim)) != head_dim:
        raise ConvertError("K and V head sizes differ; not supported")
    n_rot = int(m.arch_meta("rope.dimension_count", head_dim))
    if n_rot % 2 or n_rot > head_dim or head_dim % 2:
        raise ConvertError(f"odd rotary geometry (head_dim {head_dim}, n_rot {n_rot})")
    rf = m.tensors.get("rope_freqs.weight")
    if m.meta(Keys.Rope.LAYOUT) == Values.ROPE_LAYOUT_NORM:
        layout = "norm"
    else:
        layout = SUPPORTED_ARCHS.get(arch, layout)
    return Geometry(arch=arch, n_layer=m.layer_count(), n_head=n_head, n_head_kv=n_head_kv,
                    head_dim=head_dim, n_rot=n_rot, freq_base=float(m.arch_meta("rope.freq_base", 10000.0)),
                    layout=layout, rope_freqs=None if rf is None else np.asarray(rf.data, np.float32)[: n_rot // 2])


def pair_channels(g: Geometry, layout: str | None = None) -> np.ndarray:
    """[n_pairs, 2] head channels of each pair (rotary pairs first, by frequency)."""
    layout = layout or g.layout
    j = np.arange(g.n_rot_pairs)
    if layout == "norm":
        rot = np.stack([2 * j, 2 * j + 1], axis=1)
    elif layout == "neox":
        rot = np.stack([j, j + g.n_rot_pairs], axis=1)
    else:
        raise ValueError(layout)
    i = np.arange((g.head_dim - g.n_rot) // 2)
    rest = np.stack([g.n_rot + 2 * i, g.n_rot + 2 * i + 1], axis=1)
    return np.concatenate([rot, rest]).astype(np.int64)


def pair_perm_to_channels(pair_perm: np.ndarray, g: Geometry) -> np.ndarray:
    """Channel permutation (new channel c <- old channel perm[c]) that moves pair
    pair_perm[p] to position p, in the NORM layout."""
    ch = pair_channels(g, "norm")
    out = np.empty(g.head_dim, dtype=np.int64)
    out[ch[:, 0]] = ch[pair_perm, 0]
    out[ch[:, 1]] = ch[pair_perm, 1]
    return out


def pair_perms_to_channels(perm: np.ndarray, g: Geometry) -> np.ndarray:
    """[n_kv, head_dim] channel permutations for pair permutations perm [n_kv, n_pairs] (NORM)."""
    return np.stack([pair_perm_to_channels(p, g) for p in perm])


def pair_mag(x: np.ndarray) -> np.ndarray:
    """Pair magnitudes of NORM-order x [..., head_dim] -> [..., head_dim/2] (RoPE keeps them)."""
    return np.sqrt(x[..., 0::2].astype(np.float64) ** 2 + x[..., 1::2].astype(np.float64) ** 2)


def pair_rms(x: np.ndarray) -> np.ndarray:
    """RMS pair magnitude over the first axis of NORM-order x [T, H, head_dim] -> [H, head_dim/2]."""
    return np.sqrt((pair_mag(x) ** 2).mean(axis=0))


def head_rows(channel_perm: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """Row permutation of a [n_heads*head_dim, ...] weight: channel_perm ([hd] for
    all heads or [n_heads, hd]) applied inside each head."""
    cp = np.broadcast_to(channel_perm, (n_heads, head_dim))
    return (np.arange(n_heads)[:, None] * head_dim + cp).reshape(-1)
