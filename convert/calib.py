"""Calibration: pre-RoPE Q and K activations on calibration text.

Runs the HF-format model (transformers, CPU) on a few sequences of calibration
text and records each layer's q_proj / k_proj outputs (biases included), in the
NORM pair order of geometry.py (HF's rotate_half pairs channel j with
j + n_rot/2; they are interleaved here). RoPE is applied later in numpy:
pair magnitudes do not depend on it, and post-RoPE samples come from
smooth.rope_norm. Never calibrate on the evaluation text (WikiText-2 test).

Calibration text: the Canterbury corpus (pykvq.calib_text: alice29, asyoulik,
lcet10, plrabn12 from the brotli 1.2.1 sdist on PyPI, fetched once into
$PYKVQ_CACHE/calib).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pykvq.calib_text import _canterbury_ok, cache_dir  # noqa: F401 - _canterbury_ok: the tests reach it here
from pykvq.calib_text import canterbury_text as _canterbury_text
from pykvq.errors import FetchError
from pykvq.progress import progress_bar

from .geometry import Geometry, pair_rms
from .gguf_io import ConvertError

def canterbury_text() -> str:
    """The Canterbury corpus (pykvq.calib_text), its fetch errors as the converter's."""
    try:
        return _canterbury_text()
    except FetchError as e:
        raise ConvertError(str(e)) from None


def calibration_text(spec: str) -> tuple[str, str]:
    """(text, description) for --calib: 'canterbury' or a text file's path."""
    if spec == "canterbury":
        return canterbury_text(), "canterbury (brotli 1.2.1 testdata: alice29, asyoulik, lcet10, plrabn12)"
    p = Path(spec)
    if not p.is_file():
        raise ConvertError(f"calibration text {spec!r} not found (a file path, or 'canterbury')")
    if "wiki.test" in p.name:
        raise ConvertError(f"{p} is the evaluation text; calibrate on something else")
    return p.read_text(encoding="utf-8", errors="replace"), p.name


@dataclass
class KeyMoments:
    """One layer's pre-RoPE K per [n_kv, head_dim] channel, NORM order: what --prerope-k needs without samples."""
    mean: np.ndarray         # float64 E[k]
    sq: np.ndarray           # float64 E[k^2]
    lo: np.ndarray           # smallest k
    hi: np.ndarray           # largest k
    fisher: np.ndarray       # E[(dL/dk)^2], or its forward-pass estimate (sensitivity "forward")
    q_mean: np.ndarray | None = None   # [n_head, head_dim] E[q] of the layer's queries before RoPE


@dataclass
class Calib:
    q: list[np.ndarray] | None   # per layer [T, n_head, head_dim], NORM order, pre-RoPE (None: moments only)
    k: list[np.ndarray] | None   # per layer [T, n_kv, head_dim]
    pos: np.ndarray          # [T] positions (each sequence starts at 0)
    source: str
    # with fisher=True: V (HF channel order, as the cache stores it) and the LM loss's
    # gradients w.r.t. pre-RoPE K (NORM order) and V; their squares are the diagonal Fisher
    v: list[np.ndarray] | None = None
    gk: list[np.ndarray] | None = None
    gv: list[np.ndarray] | None = None
    km: list[KeyMoments] | None = None   # runtime calibration: per-layer K moments (always there)
    sensitivity: str = "backprop"        # where gk / gv / km.fisher come from: "backprop" or "forward"
    tokens_per_s: float | None = None    # runtime calibration: its speed (for the converter's summary)
    slot_price: dict | None = None       # --sensitivity probe: {(layer, "k" | "v"): price} (convert/slot_prices.py)
    probe_report: dict | None = None
    candidates: object | None = None     # --sensitivity measure: convert/candidate_prices.CandidateProbe

    def k_pair_rms(self, layer: int) -> np.ndarray:
        """[n_kv, n_pairs] RMS pair magnitude of K (RoPE does not change it)."""
        if self.k is None:
            sq = self.km[layer].sq
            return np.sqrt(sq[..., 0::2] + sq[..., 1::2])
        return pair_rms(self.k[layer])


def key_sensitivity(q_sq: np.ndarray, g: Geometry) -> np.ndarray:
    """Forward-pass stand-in for the keys' diagonal Fisher, [n_kv, head_dim], from the queries' mean squares q_sq
    [n_head, head_dim] (same channel order): a key error dk moves the score of query q by q.dk/sqrt(d), so a
    pre-RoPE key channel weighs E[q_c^2] of the same channel, summed over the queries of its group, over d.
    Per channel, not per rotary pair: RoPE turns q and k by the same angle, and over the distances attention
    spans most pairs turn little, so channel c of a key meets channel c of the queries. (Against the backward
    pass's Fisher on SmolLM2's calibration text, log-correlation per head, mean over layers: per channel 0.89,
    pair-averaged 0.71; weighing each query by sum_j p_j^2 of its attention, 0.88, did not pay.) The loss's own
    factor per score (dL/ds) is left out: the --prerope-k scale and q53_64's layout compare channels within a head."""
    qs = np.asarray(q_sq, np.float64)
    return qs.reshape(g.n_head_kv, g.group, g.head_dim).sum(axis=1) / g.head_dim


def value_sensitivity(wo: np.ndarray, g: Geometry) -> np.ndarray:
    """Forward stand-in for V's diagonal Fisher, [n_kv, head_dim]: an error in a value channel reaches the
    residual stream through its W_o columns (one per query head of the group); their squared norms, summed."""
    col = (np.asarray(wo, np.float64) ** 2).sum(axis=0).reshape(g.n_head, g.head_dim)
    return col.reshape(g.n_head_kv, g.group, g.head_dim).sum(axis=1)


def from_runtime(st, g: Geometry, v_sens: list[np.ndarray] | None = None, grads=None) -> Calib:
    """A Calib from pykvq.calibrate's RuntimeStats (channels in the GGUF's order, made NORM here). Sensitivities
    are the forward estimates above; with samples, per-token gk / gv carry them (constant over tokens) for the
    codebooks and budgets; v_sens (per layer value_sensitivity [n_kv, head_dim]) is needed for gv. grads
    (pykvq.gradients.RuntimeGradients, the same windows): the layer-by-layer backward pass instead, per token, as
    the transformers pass gives them (sensitivity "backprop")."""
    idx = hf_to_norm(g) if g.layout == "neox" else np.arange(g.head_dim)
    n = len(st.layers)
    if n != g.n_layer:
        raise ConvertError(f"runtime calibration saw {n} layers, the GGUF has {g.n_layer}")
    for i, ls in enumerate(st.layers):
        for w, heads in (("q", g.n_head), ("k", g.n_head_kv), ("v", g.n_head_kv)):
            if ls.mean[w].shape != (heads, g.head_dim):
                raise ConvertError(f"layer {i}: the runtime's {w.upper()} is {list(ls.mean[w].shape)} per token, "
                                   f"the converter expects [{heads}, {g.head_dim}] (per-layer head sizes or counts "
                                   "are not supported)")
    km = [KeyMoments(ls.mean["k"][:, idx], ls.sq["k"][:, idx], ls.lo["k"][:, idx], ls.hi["k"][:, idx],
                     key_sensitivity(ls.sq["q"][:, idx], g), ls.mean["q"][:, idx]) for ls in st.layers]
    have = all("k" in ls.samples for ls in st.layers)
    q = [ls.samples["q"][..., idx] for ls in st.layers] if have else None
    k = [ls.samples["k"][..., idx] for ls in st.layers] if have else None
    v = [ls.samples["v"] for ls in st.layers] if have else None
    T = st.n_seq * st.seq_len
    gk = gv = None
    if have:
        gk = [np.broadcast_to(np.sqrt(m.fisher).astype(np.float32), (T, g.n_head_kv, g.head_dim)) for m in km]
        if v_sens is not None:
            gv = [np.broadcast_to(np.sqrt(f).astype(np.float32), (T, g.n_head_kv, g.head_dim)) for f in v_sens]
    sensitivity = "forward"
    if have and grads is not None:
        if (grads.n_seq, grads.seq_len) != (st.n_seq, st.seq_len) or len(grads.k) != n:
            raise ConvertError(f"the runtime's gradients cover {grads.n_seq} x {grads.seq_len} tokens of "
                               f"{len(grads.k)} layers, its samples {st.n_seq} x {st.seq_len} of {n}")
        gk = [a[..., idx] for a in grads.k]
        gv = list(grads.v)
        for m, a in zip(km, gk):
            m.fisher = (a.astype(np.float64) ** 2).mean(axis=0)
        sensitivity = "backprop"
    pos = np.concatenate([np.arange(st.seq_len)] * st.n_seq)
    return Calib(q, k, pos, st.source, v, gk, gv, km=km, sensitivity=sensitivity, tokens_per_s=st.tokens_per_s)


def collect_cached(hf_dir: str | Path, text: str, g: Geometry, *, n_seq: int = 4, seq_len: int = 512,
                   source: str = "", progress: bool | None = None, fisher: bool = False,
                   window: tuple[int, int] | None = None) -> Calib:
    """collect(), kept in $PYKVQ_CACHE/calib/stats keyed by model, text and settings: several
    conversions of one model (the results scripts make dozens) calibrate once."""
    import hashlib
    cfg = Path(hf_dir) / "config.json"
    h = hashlib.sha256()
    for part in (str(Path(hf_dir).resolve()), cfg.read_text() if cfg.is_file() else "", text,
                 f"{n_seq}/{seq_len}/{g.n_layer}/{g.head_dim}/v1" + (f"/window{window}" if window and fisher else "")):
        h.update(part.encode("utf-8", "replace"))
    d = cache_dir() / "calib" / "stats"
    paths = [d / f"{h.hexdigest()[:24]}.{what}.npz" for what in ("fisher", "plain")]
    for p in paths[:1] if fisher else paths:
        if p.is_file():
            try:
                z = np.load(p)
                n = g.n_layer
                get = lambda w: [z[f"{w}{i}"] for i in range(n)] if f"{w}0" in z else None  # noqa: E731
                return Calib(get("q"), get("k"), z["pos"], source, get("v"), get("gk"), get("gv"))
            except Exception:                    # a damaged cache entry: calibrate again
                p.unlink(missing_ok=True)
    c = collect(hf_dir, text, g, n_seq=n_seq, seq_len=seq_len, source=source, progress=progress, fisher=fisher,
                window=window)
    d.mkdir(parents=True, exist_ok=True)
    arrays = {"pos": c.pos}
    for w in ("q", "k", "v", "gk", "gv"):
        for i, a in enumerate(getattr(c, w) or []):
            arrays[f"{w}{i}"] = a
    out = paths[0] if fisher else paths[1]
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(out)
    return c


def hf_to_norm(g: Geometry) -> np.ndarray:
    """Channel c of the NORM order is HF channel idx[c]."""
    r = g.n_rot_pairs
    j = np.arange(r)
    rot = np.stack([j, j + r], axis=1).reshape(-1)
    return np.concatenate([rot, np.arange(g.n_rot, g.head_dim)])


def _window_attention(sinks: int, window: int):
    """An HF attention function (eager, one unpadded causal sequence) whose forward pass is the model's and whose
    gradients w.r.t. K and V come only through the reads a pre-RoPE file's runtime makes of quantized cells: query t
    reads key s exactly when s < sinks or t - s < window, so those reads see K and V detached. The Fisher taken
    through it weighs each cached value by what the window and sinks leave of its error."""
    import torch
    from transformers.models.llama.modeling_llama import repeat_kv

    from .window_weights import read_exactly

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        n_rep = module.num_key_value_groups
        T = query.shape[2]
        t, s_ = torch.arange(T)[:, None], torch.arange(T)[None, :]
        exact = read_exactly(t, s_, sinks, window)
        k, v = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
        kd, vd = k.detach(), v.detach()
        s = torch.where(exact, query @ kd.transpose(2, 3), query @ k.transpose(2, 3)) * scaling
        p = torch.softmax(s.masked_fill(s_ > t, float("-inf")), dim=-1, dtype=torch.float32).to(query.dtype)
        e = exact.to(p.dtype)
        o = (p * e) @ vd + (p * (1 - e)) @ v
        return o.transpose(1, 2).contiguous(), None
    return attention


def collect(hf_dir: str | Path, text: str, g: Geometry, *, n_seq: int = 4, seq_len: int = 512,
            source: str = "", progress: bool | None = None, fisher: bool = False,
            window: tuple[int, int] | None = None) -> Calib:
    """Q and K of every layer on n_seq windows of the text; with fisher, also V and the
    gradients of the mean next-token loss w.r.t. K and V (one backward pass per sequence). window (sinks, W): the
    gradients only through the reads of quantized cells (_window_attention)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pykvq.calibrate import CalibrationError, windows
    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = tok(text, return_tensors="np")["input_ids"][0]
    try:
        seqs = windows(ids, n_seq, seq_len)
    except CalibrationError as e:
        raise ConvertError(str(e)) from None
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.eval()
    if fisher and window is not None:
        from transformers import AttentionInterface
        AttentionInterface.register("pykvq_calib_window", _window_attention(*window))
        model.config._attn_implementation = "pykvq_calib_window"
    layers = model.model.layers
    if len(layers) != g.n_layer:
        raise ConvertError(f"HF model has {len(layers)} layers, GGUF has {g.n_layer}")
    idx = torch.from_numpy(hf_to_norm(g))
    whats = ("q", "k", "v") if fisher else ("q", "k")
    got = {(w, i): [] for w in whats + ("gk", "gv") for i in range(g.n_layer)}
    live: dict = {}                                  # (which, layer) -> output tensor awaiting its gradient
    hooks = []
    for i, layer in enumerate(layers):
        mods = {"q": (g.n_head, layer.self_attn.q_proj), "k": (g.n_head_kv, layer.self_attn.k_proj),
                "v": (g.n_head_kv, layer.self_attn.v_proj)}
        for which in whats:
            n_h, mod = mods[which]
            def hook(_m, _inp, out, key=(which, i), n_h=n_h):
                y = out[0].reshape(out.shape[1], n_h, g.head_dim)
                y = y if key[0] == "v" else y[..., idx]
                got[key].append(y.detach().numpy().astype(np.float32))
                if fisher and key[0] != "q":
                    out.retain_grad()
                    live[key] = out
            hooks.append(mod.register_forward_hook(hook))
    try:
        for s in progress_bar(seqs, desc="calibration" + (" (fisher)" if fisher else ""), enable=progress,
                              unit="seq"):
            ids_t = torch.from_numpy(np.asarray(s, dtype=np.int64))[None, :]
            if not fisher:
                with torch.no_grad():
                    model(ids_t)
                continue
            for p in model.parameters():
                p.requires_grad_(False)
            emb = model.get_input_embeddings()(ids_t).detach().requires_grad_(True)
            loss = model(inputs_embeds=emb, labels=ids_t, use_cache=False).loss
            loss.backward()
            for (which, i), out in live.items():
                y = out.grad[0].reshape(out.shape[1], g.n_head_kv, g.head_dim)
                y = y if which == "v" else y[..., idx]
                got[("g" + which, i)].append(y.numpy().astype(np.float32))
            live.clear()
    finally:
        for h in hooks:
            h.remove()
    cat = {w: [np.concatenate(got[(w, i)]) for i in range(g.n_layer)] for w in whats + (("gk", "gv") if fisher else ())}
    pos = np.concatenate([np.arange(seq_len)] * n_seq)
    return Calib(cat["q"], cat["k"], pos, source, cat.get("v"), cat.get("gk"), cat.get("gv"))
