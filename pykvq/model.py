"""Model: one GGUF loaded into the patched llama.cpp with one context.

This module is the core: loading, the context and its KV-cache types, metadata, tokens, decoding,
sequences and state. Generation (pykvq/generation.py) and quality against a baseline
(pykvq/evaluation.py) are mixed into Model, so pykvq.Model has them all.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from . import cache_types, log
from ._lib import apply_settings, ffi, lib, reclaim_log
from .cache_info import KVCacheInfo
from .errors import CacheTypeError, ContextOverflowError, DecodeError, ModelLoadError, PykvqError
from .evaluation import Evaluation, kld_sweep
from .generation import Generation
from .keys import Keys, Values

__all__ = ["Model", "KVCacheInfo", "kld_sweep", "check_gguf", "check_block_fits", "KV_CACHE_TYPE_MODEL"]

GGUF_MAGIC = b"GGUF"
FLASH_ATTN = cache_types.AUTO_OFF_ON
# LLAMA_KV_CACHE_TYPE_MODEL (native/include/llama-kvq-api.h) is GGML_TYPE_COUNT, one past the last ggml type; pykvq's
# types are the last ones in the enum, so that is one past the largest id in CACHE_TYPES (checked by the tests)
KV_CACHE_TYPE_MODEL = max(cache_types.CACHE_TYPES.values()) + 1


def check_gguf(path: Path) -> None:
    """Clear errors for a missing file or one that is not GGUF at all."""
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")


# k_domain= / encoder= of Model: that context's pykvq settings (None: the environment's PYKVQ_K_DOMAIN /
# PYKVQ_ENCODER, else the process default, else auto)
K_DOMAINS = (None, "auto", "post", "pre", "centred")
ENCODERS = (None, "auto", "stock", "lsq")
_ROT_NAMES = {-1: "auto", 0: "off", 1: "on"}


@contextmanager
def _kvq_params(L, values: dict[str, object]):
    """A llama_kvq_params holding the settings given (native/llama/llama-kvq.cpp's table); one left None takes its PYKVQ_*
    environment variable when set, else the process default."""
    p = L.llama_kvq_params_init()
    try:
        apply_settings(lambda n, x: L.llama_kvq_params_set(p, n, x), values)
        yield p
    finally:
        L.llama_kvq_params_free(p)


class Model(Generation, Evaluation):
    """A GGUF model with a llama.cpp context.

    cache_type_k / cache_type_v: KV-cache types ("f16", "q8_0", "q4_0", ...); None takes
    the type a pykvq-converted GGUF was prepared for (pykvq.cache.type_k/v), else f16.
    n_ctx: context size in tokens; llama.cpp rounds it up to a multiple of 256
    (self.n_ctx is the size actually allocated).
    flash_attn: None/"auto" lets llama.cpp decide, True/False force it; a
    quantized V cache needs flash attention.
    attn_rot_k / attn_rot_v: upstream's online Hadamard rotation of the cache,
    per context: "auto" (upstream's rule: on for a quantized cache whose head
    size is a multiple of 64), "on" or "off".
    n_batch / n_ubatch: tokens per llama_decode call (default min(n_ctx, 2048)) and per graph (default 512).
    n_seq_max: number of sequences the cache holds (seq_cp needs 2 or more).
    kv_unified: one cache buffer shared by all sequences (llama.cpp's kv_unified); False gives each
    sequence a stream of its own, n_ctx / n_seq_max cells.
    k_domain: where a file converted with --prerope-k has its quantized keys cached, for this context:
    None/"auto" as the file asks (pre-RoPE), "post" plain post-RoPE, "centred" post-RoPE minus the file's
    mean rotated with them (docs/prerope.md), "pre" every layer pre-RoPE.
    encoder: how q4_0 / q5_0 cache rows are written, for this context: None/"auto" least-squares block
    scales for a pykvq-converted file and ggml's stock encoder for any other, "stock" or "lsq" to force one.
    The format is the stock one either way (docs/FORMATS.md, "Least-squares scales").
    k_centre_residual: the centred cache's residual mean energy (x the head's variance; default 0.5).
    kv_window / kv_sinks: a pre-RoPE key cache keeps the last kv_window positions up to each query and the first
    kv_sinks positions unquantized (f16) beside the quantized cache (default: the file's pykvq.cache.kv_window /
    kv_sinks, 64 and 4 in a --prerope-k file, else 0; 0 turns them off; docs/prerope.md). kv_window_type: their
    rows' type, "f16" or "q8_0" (default: the file's pykvq.cache.kv_window_type, else f16; q8_0 in CPU- and CUDA-held layers).
    repack_weights: let llama.cpp keep a repacked copy of the CPU-held weights (its extra buffer types; the
    default). False reads them from the file's pages alone: memory about the file's size; measured on this project's
    2-core AVX2 machine, Qwen2.5-Coder-1.5B Q4_K_M prefills 1.66x faster and decodes 0.75x as fast without it
    (docs/RESULTS-BY-DATE.md, 2026-12-07 (second session)).
    kv_heavy: with the window, also keep this fraction of each sequence's cells exact as heavy hitters, the keys
    scoring highest against the file's mean query (blk.N.kvq_q_mean; default: the file's pykvq.cache.kv_heavy, written
    by the converter's --kv-heavy, else 0).
    None for any of these: the environment's PYKVQ_K_DOMAIN / PYKVQ_ENCODER / PYKVQ_K_CENTRE_RESIDUAL /
    PYKVQ_KV_WINDOW / PYKVQ_KV_SINKS,
    else the process default (pykvq.use_with_llama_cpp), else auto. self.k_domain / self.encoder say what the context really runs.

    Besides what is defined here: generate / chat (pykvq/generation.py) and perplexity /
    save_logits / kl_divergence (pykvq/evaluation.py).
    """

    def __init__(self, path: str | os.PathLike | None = None, *, n_ctx: int = 4096,
                 n_batch: int | None = None, cache_type_k: str | None = None, cache_type_v: str | None = None,
                 flash_attn: bool | str | None = None, n_gpu_layers: int = 0, seed: int = 0,
                 n_threads: int | None = None, verbose: bool | None = None,
                 attn_rot_k: str | bool | None = "auto", attn_rot_v: str | bool | None = "auto",
                 n_seq_max: int = 1, kv_unified: bool = False, k_domain: str | None = None,
                 encoder: str | None = None, k_centre_residual: float | None = None,
                 kv_window: int | None = None, kv_sinks: int | None = None, kv_window_type: str | None = None,
                 kv_heavy: float | None = None, n_ubatch: int | None = None, repack_weights: bool = True,
                 _calibration=None, _probe=None):
        if k_domain not in K_DOMAINS:
            raise ValueError(f"k_domain must be one of {', '.join(map(str, K_DOMAINS))}, got {k_domain!r}")
        if encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {', '.join(map(str, ENCODERS))}, got {encoder!r}")
        if path is None:
            from .registry import default_model_path
            path = default_model_path()
        self.path = Path(path)
        self.seed = seed
        self._model = self._ctx = ffi.NULL
        self.cache_type_k, self.cache_type_v = cache_type_k, cache_type_v
        for t in (cache_type_k, cache_type_v):
            if t is not None:
                cache_types.resolve(t)          # an unknown name fails before anything loads
        rot_k = cache_types.rotation(attn_rot_k, "K")
        rot_v = cache_types.rotation(attn_rot_v, "V")
        if flash_attn not in FLASH_ATTN:
            raise ValueError(f"flash_attn must be True, False or 'auto', got {flash_attn!r}")
        if n_ctx < 8:
            raise ValueError(f"n_ctx must be at least 8, got {n_ctx}")
        check_gguf(self.path)
        if verbose is not None:
            log.set_verbose(verbose)

        L = self._lib = lib()
        reclaim_log()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers
        if not repack_weights or _calibration is not None or _probe is not None:
            mp.use_extra_bufts = False      # no repacked copy of the weights: memory ~ the file
        log.clear()
        self._model = L.llama_model_load_from_file(str(self.path).encode(), mp)
        if self._model == ffi.NULL:
            raise ModelLoadError(f"llama.cpp could not load {self.path}: {_last_error()}")
        self._vocab = L.llama_model_get_vocab(self._model)
        self.n_vocab = L.llama_vocab_n_tokens(self._vocab)
        self.n_layer = L.llama_model_n_layer(self._model)
        self.n_head = L.llama_model_n_head(self._model)
        self.n_head_kv = L.llama_model_n_head_kv(self._model)
        self.n_embd = L.llama_model_n_embd(self._model)
        self.arch = self.meta("general.architecture") or "?"
        # cache types: the caller's, else what the converter prepared the file for, else f16
        self.cache_type_source, ids = {}, {}
        for which, given in (("k", cache_type_k), ("v", cache_type_v)):
            baked = self.meta(Keys.Cache.TYPE[which])
            self.cache_type_source[which.upper()] = ("caller" if given else
                                                     f"GGUF {Keys.Cache.TYPE[which]}" if baked else "default")
            try:
                ids[which] = cache_types.resolve(given or baked or "f16")
            except CacheTypeError as e:
                self.close()
                raise CacheTypeError(f"{e} (from {self.cache_type_source[which.upper()]})") from None
        type_k, type_v = ids["k"], ids["v"]
        self.cache_type_k, self.cache_type_v = cache_types.name_of(type_k), cache_types.name_of(type_v)
        if FLASH_ATTN[flash_attn] == 0 and self.cache_type_v not in cache_types.UNQUANTIZED:
            self.close()
            raise CacheTypeError(
                f"a quantized V cache ({self.cache_type_v}) needs flash attention; "
                "use flash_attn=True or 'auto'")
        self.head_dim_k = int(self.meta(f"{self.arch}.attention.key_length") or self.n_embd // self.n_head)
        self.head_dim_v = int(self.meta(f"{self.arch}.attention.value_length") or self.n_embd // self.n_head)
        try:
            for which, t, hd in (("K", type_k, self.head_dim_k), ("V", type_v, self.head_dim_v)):
                check_block_fits(which, cache_types.name_of(t), L.ggml_blck_size(t), hd)
        except CacheTypeError:
            self.close()
            raise

        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch or min(n_ctx, 2048)
        cp.n_ubatch = min(cp.n_batch, n_ubatch or 512)
        cp.n_seq_max = n_seq_max
        cp.kv_unified = kv_unified
        threads = n_threads or os.cpu_count() or 1
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = FLASH_ATTN[flash_attn]
        # a type the caller left open goes to llama.cpp as "the model's": it applies the GGUF's per-layer
        # types (pykvq.cache.layer_types_k/v) when there are any, else the same type as resolved above
        cp.type_k = type_k if cache_type_k else KV_CACHE_TYPE_MODEL
        cp.type_v = type_v if cache_type_v else KV_CACHE_TYPE_MODEL
        cp.no_perf = True
        if _calibration is not None or _probe is not None:    # an eval callback reads the graph: one ubatch a decode
            cp.n_ubatch = cp.n_batch
        if _calibration is not None:    # pykvq.calibrate: its collector reads Q / K / V
            L.llama_kvq_calib_attach(_calibration, ffi.addressof(cp))
        if _probe is not None:          # pykvq.sensitivity: noise into one layer's K / V as the graph computes it
            L.llama_kvq_probe_attach(_probe, ffi.addressof(cp))
        log.clear()
        settings = dict(attn_rot_k=_ROT_NAMES[rot_k], attn_rot_v=_ROT_NAMES[rot_v], k_domain=k_domain,
                        encoder=encoder, k_centre_residual=k_centre_residual, kv_window=kv_window, kv_sinks=kv_sinks,
                        kv_window_type=kv_window_type, kv_heavy=kv_heavy)
        try:
            with _kvq_params(L, settings) as kvq:
                self._ctx = L.llama_kvq_init_from_model_params(self._model, cp, kvq)
        except ValueError:
            self.close()
            raise
        if self._ctx == ffi.NULL:
            self.close()
            raise CacheTypeError(
                f"llama.cpp could not create a context with K={self.cache_type_k} "
                f"V={self.cache_type_v} flash_attn={flash_attn}: {_last_error()}")
        self.n_ctx = L.llama_n_ctx(self._ctx)
        self.n_batch = L.llama_n_batch(self._ctx)
        self._mem = L.llama_get_memory(self._ctx)
        self.attn_rotation = {w: L.llama_kvq_attn_rot(self._ctx, w == "V") == 1 for w in ("K", "V")}
        # what llama.cpp allocated, layer by layer (per-layer types from the GGUF, or one type for all)
        self._layer_type_ids = [(L.llama_kvq_layer_type(self._ctx, il, False), L.llama_kvq_layer_type(self._ctx, il, True))
                                for il in range(self.n_layer)]
        for which, i in (("k", 0), ("v", 1)):
            names = {self._type_name(t[i]) for t in self._layer_type_ids if t[i] >= 0}
            if len(names) > 1:
                setattr(self, f"cache_type_{which}", "mixed")
            elif len(names) == 1:
                setattr(self, f"cache_type_{which}", names.pop())
            if L.llama_kvq_model_n_layer_types(self._model, bool(i)) > 0 and not (cache_type_k, cache_type_v)[i]:
                self.cache_type_source[which.upper()] = f"GGUF {Keys.Cache.LAYER_TYPES[which]}"
        self.add_bos = bool(L.llama_vocab_get_add_bos(self._vocab))
        self.bos = L.llama_vocab_bos(self._vocab)
        log.logger.info("pykvq: %s, %s, %s", self.path.name, self.kv_cache_info(), self.transforms())

    # ---- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        self.__dict__.pop("_baseline_memo", None)
        L = getattr(self, "_lib", None)
        if L is None:
            return
        if self._ctx != ffi.NULL:
            L.llama_free(self._ctx)
            self._ctx = ffi.NULL
        if self._model != ffi.NULL:
            L.llama_model_free(self._model)
            self._model = ffi.NULL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"Model({str(self.path)!r}, n_ctx={getattr(self, 'n_ctx', '?')}, "
                f"cache_type_k={self.cache_type_k!r}, cache_type_v={self.cache_type_v!r})")

    # ---- metadata -------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        buf = ffi.new("char[]", 4096)
        n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, 4096)
        return ffi.string(buf).decode("utf-8", "replace") if n >= 0 else None

    @property
    def description(self) -> str:
        buf = ffi.new("char[]", 256)
        self._lib.llama_model_desc(self._model, buf, 256)
        return ffi.string(buf).decode()

    @property
    def chat_template(self) -> str | None:
        p = self._lib.llama_model_chat_template(self._model, ffi.NULL)
        return ffi.string(p).decode("utf-8", "replace") if p != ffi.NULL else None

    def baked_transforms(self) -> list[str]:
        """Transforms the converter baked into the weights (pykvq.baked.* keys)."""
        out = []
        if self.meta(Keys.Baked.KSORT) == "true":
            out.append("K-sort (" + (self.meta(Keys.Baked.KSORT_KEY) or "?") + " key)")
        if self.meta(Keys.Rope.LAYOUT) == Values.ROPE_LAYOUT_NORM:
            out.append("NEOX->NORM rope layout")
        if self.meta(Keys.Baked.SMOOTH_QK) == "true":
            out.append("QK pair smoothing")
        if self.meta(Keys.Baked.LEARN_K) == "true":
            out.append("learned Q/K pair transform")
        rv = self.meta(Keys.Baked.ROTATE_V)
        if rv and rv != Values.ROTATE_V_NONE:
            out.append(f"V/O {rv}")
        if self.meta(Keys.Cache.K_DOMAIN) == Values.K_DOMAIN_PREROPE:
            out.append("pre-RoPE centred K statistics")
        return out

    def setting(self, name: str) -> str | None:
        """What this context runs for a pykvq setting (llama_kvq_get): k_domain "pre" / "centred" / "post",
        encoder "lsq" / "stock", attn_rot_k / attn_rot_v "on" / "off", kv_sinks / kv_window the exact window's sizes
        ("0": none); None without an attention KV cache."""
        buf = ffi.new("char[64]")
        n = self._lib.llama_kvq_get(self._ctx, name.encode(), buf, len(buf))
        return ffi.string(buf).decode() if n >= 0 else None

    @property
    def k_domain(self) -> str:
        """Where this context caches its keys: 'pre-RoPE' (some layer pre-RoPE: a --prerope-k file's quantized
        K layers), 'centred post-RoPE' (k_domain="centred"), else 'post-RoPE'."""
        return {"pre": "pre-RoPE", "centred": "centred post-RoPE"}.get(self.setting("k_domain"), "post-RoPE")

    @property
    def encoder(self) -> str:
        """'least-squares' when this context writes q4_0 / q5_0 cache rows with least-squares block scales (a
        pykvq-converted file, or encoder="lsq"), else 'stock'."""
        return "least-squares" if self.setting("encoder") == "lsq" else "stock"

    def transforms(self) -> str:
        """The transforms active on the KV cache, in words (for logs)."""
        rot = [w for w, on in self.attn_rotation.items() if on]
        baked = self.baked_transforms()
        sinks, win = self.setting("kv_sinks"), self.setting("kv_window")
        heavy = self.setting("kv_heavy")
        exact = (f" ({self.setting('kv_window_type') or 'f16'}: first {sinks} positions, last {win} cells"
                 + (f", {heavy} heavy hitters" if heavy not in (None, "0") else "") + ")"
                 if {sinks, win} - {None, "0"} else "")
        return ("online Hadamard rotation: " + ("+".join(rot) if rot else "off")
                + "; baked: " + (", ".join(baked) if baked else "none") + f"; keys cached {self.k_domain}{exact}"
                + f"; q4_0/q5_0 scales {self.encoder}")

    def _type_name(self, type_id: int) -> str:
        try:
            return cache_types.name_of(type_id)
        except CacheTypeError:
            return ffi.string(self._lib.ggml_type_name(type_id)).decode()

    def layer_cache_types(self) -> list[tuple[str | None, str | None]]:
        """(K type, V type) of each layer's cache as llama.cpp allocated it; None for a layer without one."""
        return [tuple(self._type_name(t) if t >= 0 else None for t in ids) for ids in self._layer_type_ids]

    def codebook_sources(self) -> list[tuple[str, str]]:
        """Where each layer's K / V nuq codebook comes from: "file", "fallback", or "" (not a nuq cache)."""
        names = {0: "", 1: "file", 2: "fallback"}
        return [tuple(names.get(self._lib.llama_kvq_codebook_source(self._ctx, il, v), "?") for v in (False, True))
                for il in range(self.n_layer)]

    def kv_cache_info(self) -> KVCacheInfo:
        L = self._lib
        nk, nv = self.n_head_kv * self.head_dim_k, self.n_head_kv * self.head_dim_v
        f16 = cache_types.resolve("f16")
        ids = [t for t in self._layer_type_ids if t[0] >= 0]
        layer_bytes = tuple((L.ggml_row_size(tk, nk), L.ggml_row_size(tv, nv) if tv >= 0 else 0) for tk, tv in ids)
        n = max(len(ids), 1)
        return KVCacheInfo(
            type_k=self.cache_type_k, type_v=self.cache_type_v, n_ctx=self.n_ctx, n_layer=len(ids),
            n_embd_k_gqa=nk, n_embd_v_gqa=nv,
            bytes_k_per_token_layer=sum(b[0] for b in layer_bytes) / n,
            bytes_v_per_token_layer=sum(b[1] for b in layer_bytes) / n,
            bytes_f16_per_token_layer=L.ggml_row_size(f16, nk) + L.ggml_row_size(f16, nv),
            layer_types=tuple(tuple(self._type_name(t) if t >= 0 else None for t in pair) for pair in ids),
            layer_bytes=layer_bytes)

    def kv_cache_bytes(self) -> int:
        """Bytes of K and V cache this context holds (all layers, all n_ctx cells)."""
        return self.kv_cache_info().total_bytes

    # ---- tokens ---------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return _tokenize(self._lib, self._vocab, text, add_special, parse_special)

    def detokenize(self, tokens, *, special: bool = False) -> str:
        toks = ffi.new("llama_token[]", list(tokens))
        n_tok = len(toks)
        cap = max(64, 8 * n_tok)
        for _ in range(2):
            buf = ffi.new("char[]", cap)
            n = self._lib.llama_detokenize(self._vocab, toks, n_tok, buf, cap, not special, special)
            if n >= 0:
                return ffi.unpack(buf, n).decode("utf-8", "replace")
            cap = -n
        raise PykvqError("detokenization failed")

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        buf = ffi.new("char[]", 256)
        n = self._lib.llama_token_to_piece(self._vocab, token, buf, 256, 0, special)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        return ffi.unpack(buf, n)

    def apply_chat_template(self, messages: list[dict]) -> str | None:
        """Render messages with the model's template (llama.cpp's built-in
        template detection); None when the model has no usable template."""
        tmpl = self._lib.llama_model_chat_template(self._model, ffi.NULL)
        if tmpl == ffi.NULL:
            return None
        keep = [(ffi.new("char[]", m["role"].encode()), ffi.new("char[]", m["content"].encode()))
                for m in messages]
        chat = ffi.new("llama_chat_message[]", len(keep))
        for i, (r, c) in enumerate(keep):
            chat[i].role, chat[i].content = r, c
        cap = 2 * sum(len(m["content"]) + len(m["role"]) for m in messages) + 256
        for _ in range(2):
            buf = ffi.new("char[]", cap)
            n = self._lib.llama_chat_apply_template(tmpl, chat, len(keep), True, buf, cap)
            if n < 0:
                return None
            if n <= cap:
                return ffi.unpack(buf, n).decode("utf-8")
            cap = n
        return None

    # ---- decoding -------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the KV cache."""
        self._lib.llama_memory_clear(self._mem, True)

    def _decode(self, tokens, pos0: int, output_from: int | None = None,
                collect: bool = False, seq: int = 0) -> list[np.ndarray]:
        """Decode tokens at positions pos0.. in batches of n_batch, with outputs
        for positions >= output_from (default: only the last). With collect,
        return the logits of every output row, in order."""
        return [r for r in self._decode_batches(tokens, pos0, output_from, collect, seq) if r is not None]

    def _decode_batches(self, tokens, pos0: int, output_from: int | None, collect: bool, seq: int, copy: bool = True):
        """_decode one batch at a time: yields each batch's output logits (None without collect or outputs)."""
        L = self._lib
        n = len(tokens)
        if output_from is None:
            output_from = pos0 + n - 1
        batch = L.llama_batch_init(self.n_batch, 0, 1)
        try:
            for s in range(0, n, self.n_batch):
                m = min(self.n_batch, n - s)
                batch.n_tokens = m
                n_out = 0
                for j in range(m):
                    p = pos0 + s + j
                    batch.token[j] = tokens[s + j]
                    batch.pos[j] = p
                    batch.n_seq_id[j] = 1
                    batch.seq_id[j][0] = seq
                    out = p >= output_from
                    batch.logits[j] = out
                    n_out += out
                rc = L.llama_decode(self._ctx, batch)
                if rc != 0:
                    raise DecodeError(f"llama_decode failed ({rc}): {_last_error()}")
                yield self._logits(n_out, copy) if collect and n_out else None
        finally:
            L.llama_batch_free(batch)

    # ---- cache surgery: context shift, sequences, state ------------------------------------
    def decode(self, tokens, pos0: int, seq: int = 0) -> np.ndarray:
        """Append tokens to sequence seq at positions pos0..; logits of the last one."""
        if not len(tokens):
            raise ValueError("decode needs at least one token")
        return self._decode(list(tokens), pos0, collect=True, seq=seq)[-1][-1]

    def seq_rm(self, p0: int = -1, p1: int = -1, seq: int = 0) -> bool:
        """Drop cells of sequence seq with positions in [p0, p1) (-1: open end)."""
        return bool(self._lib.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def seq_add(self, p0: int, p1: int, delta: int, seq: int = 0) -> None:
        """Move positions [p0, p1) of seq by delta; the next decode re-ropes K (K-shift)."""
        if not self._lib.llama_memory_can_shift(self._mem):
            raise DecodeError("this model's memory cannot shift positions")
        self._lib.llama_memory_seq_add(self._mem, seq, p0, p1, delta)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Share the cells of sequence src with sequence dst (needs n_seq_max > dst)."""
        self._lib.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def pos_max(self, seq: int = 0) -> int:
        return int(self._lib.llama_memory_seq_pos_max(self._mem, seq))

    def get_state(self) -> bytes:
        """The context's state (KV cache included) as bytes."""
        n = self._lib.llama_state_get_size(self._ctx)
        buf = ffi.new("uint8_t[]", n)
        got = self._lib.llama_state_get_data(self._ctx, buf, n)
        return bytes(ffi.buffer(buf, got))

    def set_state(self, data: bytes) -> None:
        """Restore a state from get_state (same model, cache types and n_ctx)."""
        log.clear()
        got = self._lib.llama_state_set_data(self._ctx, data, len(data))
        if got != len(data):
            raise DecodeError(f"llama.cpp rejected the state ({got} of {len(data)} bytes read): {_last_error()}")

    def save_state_file(self, path: str | os.PathLike, tokens) -> None:
        """Write the context's state and the tokens it holds to a session file (llama_state_save_file)."""
        toks = ffi.new("llama_token[]", list(tokens))
        if not self._lib.llama_state_save_file(self._ctx, os.fsencode(path), toks, len(toks)):
            raise PykvqError(f"could not write the session file {path}: {_last_error()}")

    def load_state_file(self, path: str | os.PathLike, max_tokens: int | None = None) -> list[int]:
        """Restore a session file written by save_state_file (same model and cache layout); its tokens."""
        cap = max_tokens or self.n_ctx
        toks, n = ffi.new("llama_token[]", cap), ffi.new("size_t *")
        log.clear()
        if not self._lib.llama_state_load_file(self._ctx, os.fsencode(path), toks, cap, n):
            raise DecodeError(f"llama.cpp rejected the session file {path}: {_last_error()}")
        return list(ffi.unpack(toks, n[0]))

    def get_seq_state(self, seq: int = 0) -> bytes:
        """One sequence's cells (llama_state_seq_get_data), for set_seq_state into any sequence."""
        n = self._lib.llama_state_seq_get_size(self._ctx, seq)
        buf = ffi.new("uint8_t[]", n)
        got = self._lib.llama_state_seq_get_data(self._ctx, buf, n, seq)
        return bytes(ffi.buffer(buf, got))

    def set_seq_state(self, data: bytes, seq: int = 0) -> None:
        """Put a sequence saved by get_seq_state into sequence seq (its old cells are dropped)."""
        log.clear()
        if self._lib.llama_state_seq_set_data(self._ctx, data, len(data), seq) == 0:
            raise DecodeError(f"llama.cpp rejected the sequence state for seq {seq}: {_last_error()}")

    def used_cells(self, seq: int = -1) -> int:
        """Cells of the KV cache in use: held by seq, or by any sequence for seq = -1 (every stream and
        attention cache summed; llama_kvq_memory_used_cells)."""
        return int(self._lib.llama_kvq_memory_used_cells(self._ctx, seq))

    def _logits(self, n_rows: int, copy: bool = True) -> np.ndarray:
        ptr = self._lib.llama_get_logits(self._ctx)
        rows = np.frombuffer(ffi.buffer(ptr, 4 * n_rows * self.n_vocab), dtype=np.float32)
        rows = rows.reshape(n_rows, self.n_vocab)
        if copy:
            return rows.copy()
        rows.flags.writeable = False
        return rows

    def eval_logits(self, tokens, output_from: int = 0) -> np.ndarray:
        """Logits (float32, [n - output_from, n_vocab]) for tokens evaluated from
        an empty cache at positions 0.., rows for positions >= output_from."""
        rows = list(self.iter_logits(tokens, output_from))
        return np.concatenate(rows) if len(rows) > 1 else rows[0]

    def iter_logits(self, tokens, output_from: int = 0, copy: bool = True):
        """eval_logits a batch at a time (float32 [rows, n_vocab] arrays, in order): a long context's rows without
        all of them in memory at once (8192 rows of a 150k vocabulary are 5 GB). copy=False yields read-only views of
        llama.cpp's own logits buffer, valid only until the next batch is asked for (a batch's rows less)."""
        tokens = list(tokens)
        if len(tokens) > self.n_ctx:
            raise ContextOverflowError(f"{len(tokens)} tokens do not fit the context of {self.n_ctx}")
        self.reset()
        for r in self._decode_batches(tokens, 0, output_from, True, 0, copy):
            if r is not None:
                yield r


def _tokenize(L, vocab, text: str, add_special: bool, parse_special: bool) -> list[int]:
    data = text.encode("utf-8")
    cap = len(data) + 16
    buf = ffi.new("llama_token[]", cap)
    n = L.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    if n < 0:
        cap = -n
        buf = ffi.new("llama_token[]", cap)
        n = L.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
    if n < 0:
        raise PykvqError(f"tokenization failed ({n})")
    return list(ffi.unpack(buf, n))


def tokenize_file(path: str | os.PathLike, text: str) -> tuple[list[int], int | None]:
    """text's tokens by the GGUF's own tokenizer, without special tokens, and the BOS the model wants first in a
    window (None where it wants none), as Model.tokenize and Model.add_bos give them; only the vocabulary is
    loaded, none of the weights."""
    path = Path(path)
    check_gguf(path)
    L = lib()
    reclaim_log()
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    log.clear()
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    if model == ffi.NULL:
        raise ModelLoadError(f"llama.cpp could not load {path}'s vocabulary: {_last_error()}")
    try:
        vocab = L.llama_model_get_vocab(model)
        bos = int(L.llama_vocab_bos(vocab)) if L.llama_vocab_get_add_bos(vocab) else None
        return _tokenize(L, vocab, text, False, False), bos
    finally:
        L.llama_model_free(model)


def check_block_fits(which: str, type_name: str, block: int, head_dim: int) -> None:
    """A cache row is one head; its blocks must tile it exactly."""
    if head_dim % block:
        raise CacheTypeError(
            f"{which} cache type {type_name} has blocks of {block} values, "
            f"which do not divide this model's head size {head_dim}; pick a type with "
            f"{'32' if head_dim % 32 == 0 else 'smaller'}-value blocks or f16")


def _last_error() -> str:
    text = log.recent_text(12)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-4:]) if lines else "no details from llama.cpp"
