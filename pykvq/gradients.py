"""Runtime gradients: per layer and token, the gradient of the next-token loss w.r.t. pre-RoPE K and V.

    g = pykvq.gradients.collect("model.gguf", text, n_seq=4, seq_len=512)
    g.k[il]   # float32 [n_seq * seq_len, n_head_kv, head_dim], the GGUF's channel order (as pykvq.calibrate's)

llama.cpp's training graph runs the GGUF's own quantized weights forward and backward on the CPU
(native/llama/llama-kvq-grad.cpp): the squares of these gradients are the diagonal Fisher that codebooks and
--kv-bits budgets weigh cache errors with, without the f32 copy of the model that transformers' backward pass needs.
The memory is the model's plus every activation of one window kept for the backward pass (Qwen2.5-Coder-1.5B at 512
tokens: about 4 GB in all; peak_bytes estimates it), and the products round activations to 8 bits. The converter
now takes the same gradients from convert/layer_gradients.py (float32, one layer in memory at a time: 1.34 GiB
for that model's whole --bits 3.5 conversion) and uses this module's windows (token_windows) and result type only.

With window=(sinks, cells) the gradients come only through the reads that a pre-RoPE file's runtime makes of
quantized cells (the attention graph takes the exact ones through copies of K and V without a gradient), as
convert/calib.py's transformers pass takes them for a window-weighted budget.

The windows and tokens are pykvq.calibrate.collect's (a BOS first where the model wants one), so the gradients
line up token for token with its samples; each window's last label is the text's next token.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._lib import ffi
from .calibrate import CalibrationError, windows
from .progress import progress_bar


# architectures whose training graph is known to have a backward pass for every op (ggml has none for GELU, NORM,
# MUL_MAT_ID or flash attention, and aborts on them, so any other architecture is refused, not tried)
BACKWARD_ARCHS = ("llama", "qwen2")


def unavailable(arch: str | None, seq_len: int) -> str | None:
    """Why collect() cannot run on this architecture (None: not known yet) and window length, or None."""
    if arch is not None and arch not in BACKWARD_ARCHS:
        return f"runtime gradients run {' / '.join(BACKWARD_ARCHS)} graphs, not {arch}"
    if seq_len < 256 or seq_len % 256:
        return f"runtime gradients take windows of a multiple of 256 tokens, not {seq_len}"
    return None


def peak_bytes(weight_bytes: int, n_layer: int, n_embd: int, n_ff: int, n_head: int, seq_len: int) -> int:
    """About collect()'s peak memory: the weights (read, not mapped) and every activation of one window that the
    backward pass keeps, per layer and token about 12 n_embd + 4 n_ff + 2 n_head seq_len floats, fitted with a
    margin to the measured peaks of one 512-token pass (SmolLM2-135M 1.15 GB, Qwen2.5-Coder-1.5B 4.07 GB; the
    estimate gives 1.7 and 5.1)."""
    per_token = 12 * n_embd + 4 * n_ff + 2 * n_head * seq_len
    return int(weight_bytes + 4 * n_layer * seq_len * per_token + (256 << 20))


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


def collect(model_path: str | os.PathLike, text: str, *, n_seq: int = 4, seq_len: int = 512,
            progress: bool | None = None, n_threads: int | None = None,
            window: tuple[int, int] | None = None) -> RuntimeGradients:
    """window (sinks, cells): gradients only through the reads a pre-RoPE file's runtime makes of quantized cells
    (query t reads key s exactly when s < sinks or t - s < cells), as convert/calib.py's transformers pass takes
    them for a window-weighted budget."""
    from ._lib import lib
    from .model import Model
    # llama.cpp pads a context to 256 cells, and the training graph takes the whole context as one batch
    why = unavailable(None, seq_len)
    if n_seq < 1 or why:
        raise CalibrationError(why or f"runtime gradients need at least one window, got {n_seq}")
    L = lib()
    grad = L.llama_kvq_grad_init()
    if window is not None and not L.llama_kvq_grad_set_window(grad, int(window[0]), int(window[1])):
        err = ffi.string(L.llama_kvq_grad_error(grad)).decode()
        L.llama_kvq_grad_free(grad)
        raise CalibrationError(f"runtime gradients: {err}")
    m = None
    name = Path(model_path).name
    try:
        m = Model(model_path, n_ctx=seq_len, n_batch=seq_len, cache_type_k="f32", cache_type_v="f32",
                  flash_attn=False, n_threads=n_threads, _gradients=grad)
        if m.arch not in BACKWARD_ARCHS:
            raise CalibrationError(f"{name}: {unavailable(m.arch, seq_len)} (ggml has no backward pass for some of its ops); use "
                                   "--sensitivity probe")
        seqs = token_windows(m.tokenize(text, add_special=False), n_seq, seq_len, m.bos if m.add_bos else None)
        ks: list[list] = []
        vs: list[list] = []
        losses = []
        t0 = time.time()
        bar = progress_bar(seqs, desc="gradients", enable=progress, unit="seq")
        for inp, lab in bar:
            a = ffi.new("llama_token[]", inp)
            b = ffi.new("llama_token[]", lab)
            if not L.llama_kvq_grad_run(grad, m._ctx, a, b, len(inp)):
                err = ffi.string(L.llama_kvq_grad_error(grad)).decode()
                raise CalibrationError(f"{name}: runtime gradients: {err}")
            losses.append(L.llama_kvq_grad_loss(grad))
            n_layer = L.llama_kvq_grad_n_layer(grad)
            if n_layer != m.n_layer:
                raise CalibrationError(f"{name}: runtime gradients reached the K of {n_layer} of {m.n_layer} layers")
            for il in range(n_layer):
                if il == len(ks):
                    ks.append([])
                    vs.append([])
                ks[il].append(_get(L, grad, il, 1, len(inp), m.n_head_kv, name))
                vs[il].append(_get(L, grad, il, 2, len(inp), m.n_head_kv, name))
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(f"loss {np.mean(losses):.3f}")
        seconds = time.time() - t0
        return RuntimeGradients([np.concatenate(x) for x in ks], [np.concatenate(x) for x in vs], n_seq, seq_len,
                                float(np.mean(losses)), seconds)
    finally:
        if m is not None:
            m.close()
        L.llama_kvq_grad_free(grad)


def _get(L, grad, il: int, which: int, n_tok: int, n_head_kv: int, name: str) -> np.ndarray:
    hd, nh = ffi.new("int64_t *"), ffi.new("int64_t *")
    n = L.llama_kvq_grad_get(grad, il, which, hd, nh, ffi.NULL, 0)
    if n <= 0 or n % (n_tok * n_head_kv):
        raise CalibrationError(f"{name}: layer {il} gave no {'KV'[which - 1]} gradient of {n_tok} tokens x "
                               f"{n_head_kv} heads")
    a = np.empty(n, np.float32)
    L.llama_kvq_grad_get(grad, il, which, hd, nh, ffi.cast("float *", ffi.from_buffer(a)), n)
    return a.reshape(n_tok, n_head_kv, -1)


def collect_cached(model_path: str | os.PathLike, text: str, *, n_seq: int = 4, seq_len: int = 512,
                   progress: bool | None = None, window: tuple[int, int] | None = None) -> RuntimeGradients:
    """collect(), kept in $PYKVQ_CACHE/calib/grad (Qwen2.5-Coder-1.5B, 4 x 512 tokens: 117 MB), keyed as
    pykvq.calibrate's cache is, and by this module."""
    import hashlib

    from .calibrate import cache_key
    from .paths import cache_dir
    h = hashlib.sha256((cache_key(model_path, text, n_seq, seq_len, True) + Path(__file__).read_text()
                        + f"/window{tuple(window) if window else None}").encode())
    f = cache_dir() / "calib" / "grad" / f"{h.hexdigest()[:24]}.npz"
    if f.is_file():
        try:
            return RuntimeGradients.load(f, n_seq, seq_len)
        except Exception:                # a damaged entry: run again
            f.unlink(missing_ok=True)
    g = collect(model_path, text, n_seq=n_seq, seq_len=seq_len, progress=progress, window=window)
    f.parent.mkdir(parents=True, exist_ok=True)
    g.save(f)
    return g
