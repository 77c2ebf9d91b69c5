"""A llama / qwen2 decoder layer forward and backward in float32 numpy: the loss's gradients w.r.t. each layer's
pre-RoPE K and V, one layer at a time (convert/layer_gradients.py drives it from a GGUF).

Pure functions on GGUF-layout weights ([out, in] rows, K and V in the file's channel order). The backward pass is
written out by hand rather than taken from an autodiff graph so that it needs one layer's weights and activations
at a time: the layer's forward is recomputed from its saved input (the residual stream), then its vector-Jacobian
product carries the upstream gradient down. With an exact window the gradients reach K and V only through the
reads a pre-RoPE file's runtime makes of quantized cells, as convert/calib.py's transformers attention takes them
(_window_attention: the exact reads see K and V detached; Q gets its gradient through every read).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .window_weights import read_exactly

FFN_CHUNK = 512       # tokens per FFN pass: its [tokens, n_ff] activations are the layer's largest


@dataclass(frozen=True)
class Shape:
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    layout: str                   # "norm": pairs (2j, 2j+1); "neox": pairs (j, j + n_rot/2)
    inv_freq: np.ndarray          # [n_rot/2] radians per position of each rotary pair
    eps: float                    # RMS norm epsilon

    @property
    def group(self) -> int:
        return self.n_head // self.n_head_kv


@dataclass
class LayerWeights:
    attn_norm: np.ndarray         # [n_embd]
    wq: np.ndarray                # [n_head * hd, n_embd]
    wk: np.ndarray                # [n_kv * hd, n_embd]
    wv: np.ndarray
    wo: np.ndarray                # [n_embd, n_head * hd]
    ffn_norm: np.ndarray
    w_gate: np.ndarray            # [n_ff, n_embd]
    w_up: np.ndarray
    w_down: np.ndarray            # [n_embd, n_ff]
    bq: np.ndarray | None = None  # qwen2's projection biases
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None


def rms_norm(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(x / rms(x), 1 / rms(x) [T, 1]) per row."""
    r = 1.0 / np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True) + eps)
    return (x * r).astype(np.float32), r.astype(np.float32)


def rms_norm_back(dy: np.ndarray, x: np.ndarray, r: np.ndarray) -> np.ndarray:
    """d/dx of x * r(x), given dy: r dy - x r^3 mean(dy x)."""
    m = np.mean(dy.astype(np.float64) * x, axis=-1, keepdims=True)
    return (r * dy - x * (r.astype(np.float64) ** 3 * m)).astype(np.float32)


def rope_tables(pos: np.ndarray, s: Shape) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, 1, n_rot/2] of each token's angles (float64 angles, as ggml computes theta in float)."""
    theta = np.asarray(pos, np.float64)[:, None] * s.inv_freq[None, :]
    return np.cos(theta).astype(np.float32)[:, None, :], np.sin(theta).astype(np.float32)[:, None, :]


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, s: Shape) -> np.ndarray:
    """x [T, H, hd] turned pair by pair; with -sin it is the turn's transpose (the backward pass)."""
    y = x.copy()
    h = s.n_rot // 2
    if s.layout == "norm":
        a, b = x[..., 0:s.n_rot:2], x[..., 1:s.n_rot:2]
        y[..., 0:s.n_rot:2] = a * cos - b * sin
        y[..., 1:s.n_rot:2] = a * sin + b * cos
    elif s.layout == "neox":
        a, b = x[..., :h], x[..., h:s.n_rot]
        y[..., :h] = a * cos - b * sin
        y[..., h:s.n_rot] = a * sin + b * cos
    else:
        raise ValueError(s.layout)
    return y


def exact_reads(seq_len: int, window: tuple[int, int] | None) -> np.ndarray | None:
    """[t, s] float32 1 where query t reads key s from the window's exact rows (None: no window)."""
    if window is None:
        return None
    t, k = np.arange(seq_len)[:, None], np.arange(seq_len)[None, :]
    return read_exactly(t, k, window[0], window[1]).astype(np.float32)


def attention(qr: np.ndarray, kr: np.ndarray, v: np.ndarray, s: Shape, seq_len: int
              ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Causal attention over sequences of seq_len tokens (positions from 0), GQA (query head h reads KV head
    h // group). -> (out [T, n_head, hd], P: per sequence and KV head [group, S, S], kept for the backward)."""
    T = qr.shape[0]
    scale = np.float32(1.0 / np.sqrt(s.head_dim))
    causal = np.triu(np.ones((seq_len, seq_len), bool), 1)
    out = np.empty_like(qr)
    probs = []
    for a in range(0, T, seq_len):
        for g in range(s.n_head_kv):
            hs = slice(g * s.group, (g + 1) * s.group)
            q = qr[a:a + seq_len, hs].transpose(1, 0, 2)                    # [grp, S, hd]
            sc = (q @ kr[a:a + seq_len, g].T) * scale
            sc[:, causal] = -np.inf
            sc -= sc.max(axis=-1, keepdims=True)
            p = np.exp(sc)
            p /= p.sum(axis=-1, keepdims=True)
            out[a:a + seq_len, hs] = (p @ v[a:a + seq_len, g]).transpose(1, 0, 2)
            probs.append(p)
    return out, probs


def attention_back(do: np.ndarray, qr: np.ndarray, kr: np.ndarray, v: np.ndarray, probs: list[np.ndarray],
                   s: Shape, seq_len: int, exact: np.ndarray | None):
    """-> (dqr [T, n_head, hd], dkr, dv [T, n_kv, hd]); K and V take no gradient through exact reads."""
    scale = np.float32(1.0 / np.sqrt(s.head_dim))
    dq, dk, dv = np.empty_like(qr), np.empty_like(kr), np.empty_like(v)
    far = None if exact is None else 1.0 - exact
    it = iter(probs)
    for a in range(0, qr.shape[0], seq_len):
        for g in range(s.n_head_kv):
            hs = slice(g * s.group, (g + 1) * s.group)
            p = next(it)                                                    # [grp, S, S]
            d = do[a:a + seq_len, hs].transpose(1, 0, 2)                    # [grp, S, hd]
            vg, kg = v[a:a + seq_len, g], kr[a:a + seq_len, g]
            dp = d @ vg.T
            pf = p if far is None else p * far
            dv[a:a + seq_len, g] = np.einsum("gts,gtd->sd", pf, d, optimize=True)
            ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) * scale
            dq[a:a + seq_len, hs] = (ds @ kg).transpose(1, 0, 2)
            dsf = ds if far is None else ds * far
            q = qr[a:a + seq_len, hs].transpose(1, 0, 2)
            dk[a:a + seq_len, g] = np.einsum("gts,gtd->sd", dsf, q, optimize=True)
    return dq, dk, dv


def _proj(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    y = x @ w.T
    return y if b is None else y + b


def _qkv(x: np.ndarray, w: LayerWeights, s: Shape):
    """-> (1 / rms of x, pre-RoPE q [T, n_head, hd], k and v [T, n_kv, hd])."""
    T = x.shape[0]
    h1, r1 = rms_norm(x, s.eps)
    h1w = h1 * w.attn_norm
    q = _proj(h1w, w.wq, w.bq).reshape(T, s.n_head, s.head_dim)
    k = _proj(h1w, w.wk, w.bk).reshape(T, s.n_head_kv, s.head_dim)
    v = _proj(h1w, w.wv, w.bv).reshape(T, s.n_head_kv, s.head_dim)
    return r1, q, k, v


def _ffn(x2: np.ndarray, w: LayerWeights, s: Shape, dy: np.ndarray | None = None) -> np.ndarray:
    """Forward (dy None): x2 + FFN(x2). Backward: d/dx2 of that, given its gradient dy. Token by token, in chunks."""
    out = np.empty_like(x2)
    for a in range(0, x2.shape[0], FFN_CHUNK):
        x = x2[a:a + FFN_CHUNK]
        h, r = rms_norm(x, s.eps)
        hw = h * w.ffn_norm
        gate, up = hw @ w.w_gate.T, hw @ w.w_up.T
        sg = np.negative(gate)                      # sigmoid(gate), in place: these are [chunk, n_ff] each
        np.exp(sg, out=sg)
        sg += 1.0
        np.reciprocal(sg, out=sg)
        silu = gate * sg
        if dy is None:
            silu *= up
            out[a:a + FFN_CHUNK] = x + silu @ w.w_down.T
            continue
        d = dy[a:a + FFN_CHUNK]
        da = d @ w.w_down
        # d silu / d gate = sg (1 + gate (1 - sg)) = sg + silu (1 - sg)
        dgate = 1.0 - sg
        dgate *= silu
        dgate += sg
        dgate *= up
        dgate *= da
        da *= silu                                  # the up branch's gradient
        dh = dgate @ w.w_gate + da @ w.w_up
        out[a:a + FFN_CHUNK] = d + rms_norm_back(dh * w.ffn_norm, x, r)
    return out


def layer_forward(x: np.ndarray, w: LayerWeights, s: Shape, cos, sin, seq_len: int, keep=None) -> np.ndarray:
    """The layer's output residual stream [T, n_embd] from its input x; keep(q, k, v), if given, sees its pre-RoPE
    Q, K and V."""
    _, q, k, v = _qkv(x, w, s)
    if keep is not None:
        keep(q, k, v)
    qr, kr = rope(q, cos, sin, s), rope(k, cos, sin, s)
    del q, k
    o, _ = attention(qr, kr, v, s, seq_len)
    x2 = x + o.reshape(x.shape[0], -1) @ w.wo.T
    return _ffn(x2, w, s)


def layer_backward(x: np.ndarray, dy: np.ndarray, w: LayerWeights, s: Shape, cos, sin, seq_len: int,
                   exact: np.ndarray | None):
    """The layer's forward recomputed from its input x, then the gradient dy of its output carried down.
    -> (dx [T, n_embd], dk [T, n_kv, hd] w.r.t. pre-RoPE K, dv [T, n_kv, hd])."""
    T = x.shape[0]
    r1, q, k, v = _qkv(x, w, s)
    qr, kr = rope(q, cos, sin, s), rope(k, cos, sin, s)
    del q, k
    o, probs = attention(qr, kr, v, s, seq_len)
    x2 = x + o.reshape(T, -1) @ w.wo.T
    del o
    dx2 = _ffn(x2, w, s, dy)
    del x2
    do = (dx2 @ w.wo).reshape(T, s.n_head, s.head_dim)
    dqr, dkr, dv = attention_back(do, qr, kr, v, probs, s, seq_len, exact)
    del probs, do
    dq, dk = rope(dqr, cos, -sin, s), rope(dkr, cos, -sin, s)
    dh = dq.reshape(T, -1) @ w.wq + dk.reshape(T, -1) @ w.wk + dv.reshape(T, -1) @ w.wv
    dx = dx2 + rms_norm_back(dh * w.attn_norm, x, r1)
    return dx, dk, dv


def head_backward(x: np.ndarray, norm_w: np.ndarray, eps: float, row_chunks, label_rows: np.ndarray,
                  seq_len: int) -> tuple[np.ndarray, float]:
    """The mean next-token loss of each sequence and its gradient w.r.t. the last layer's output x [T, n_embd].
    row_chunks yields the output matrix's rows [C, n_embd] in vocabulary order; label_rows [T, n_embd] are the
    labels' rows. One pass over the vocabulary (an online softmax): the logits are never held whole.
    -> (dx, the loss averaged over the sequences)."""
    h, r = rms_norm(x, eps)
    hw = (h * norm_w).astype(np.float32)
    T = x.shape[0]
    m = np.full((T, 1), -np.inf, np.float32)
    z = np.zeros((T, 1), np.float64)
    acc = np.zeros_like(hw)                    # sum_v exp(l_v - m) W_v
    for rows in row_chunks:
        lg = hw @ rows.T
        m_new = np.maximum(m, lg.max(axis=1, keepdims=True))
        c = np.exp(m - m_new)
        e = np.exp(lg - m_new)
        z = z * c + e.sum(axis=1, keepdims=True, dtype=np.float64)
        acc = acc * c + e @ rows
        m = m_new
    label_logit = np.sum(hw * label_rows, axis=1, keepdims=True)
    loss = float(np.mean(m + np.log(z) - label_logit))
    dhw = (acc / z.astype(np.float32) - label_rows) / np.float32(seq_len)
    return rms_norm_back(dhw * norm_w, x, r), loss
