"""pykvq's GGUF metadata keys, their values and per-layer tensor names: the one table.

In the style of gguf-py's ``Keys`` (nested classes of string constants) and ``TENSOR_NAMES``
(name templates with ``{bid}``, the layer). The converter (convert/) writes these, the patched
runtime (native/, native/patches) and pykvq.Model read them; native/include/llama-kvq-keys.h
mirrors this file as ``LLAMA_KVQ_KEY_<CLASS>_<NAME>``, ``LLAMA_KVQ_VALUE_<NAME>`` and
``LLAMA_KVQ_TENSOR_<NAME>`` (``{bid}`` written ``%d``), checked by tests/test_keys.py.
Renaming one breaks every file already converted. Cache type names and ggml type ids live in
pykvq/cache_types.py.

    m.meta(Keys.Cache.TYPE_K)                        # "nuq4"
    Tensors.CODEBOOK_K.format(bid=3)                 # "blk.3.kvq_codebook_k"
"""
from __future__ import annotations


class Keys:
    class General:
        VERSION = "pykvq.version"                            # the converter's version; present = converted

    class Cache:
        """What the cache of a converted file is prepared for (read by the runtime unless noted)."""
        TYPE_K = "pykvq.cache.type_k"                        # default K / V cache type
        TYPE_V = "pykvq.cache.type_v"
        LAYER_TYPES_K = "pykvq.cache.layer_types_k"          # [str] per layer (--kv-bits)
        LAYER_TYPES_V = "pykvq.cache.layer_types_v"
        CODEBOOK_METHOD = "pykvq.cache.codebook_method"      # informative: fisher / kmeans / uniform
        CODEBOOK_QNORM = "pykvq.cache.codebook_qnorm"        # informative: Q-Norm folded into the codebooks
        CODEBOOK_ROT_K = "pykvq.cache.codebook_rot_k"        # codebooks fitted with the online rotation on
        CODEBOOK_ROT_V = "pykvq.cache.codebook_rot_v"
        K_DOMAIN = "pykvq.cache.k_domain"                    # Values.K_DOMAIN_*
        K_SCALE_METHOD = "pykvq.cache.k_scale_method"        # informative: how the pre-RoPE scale was chosen
        KV_SINKS = "pykvq.cache.kv_sinks"                    # uint32: default exact sinks (pre-RoPE keys)
        KV_WINDOW = "pykvq.cache.kv_window"                  # uint32: default exact window, cells per sequence
        KV_WINDOW_TYPE = "pykvq.cache.kv_window_type"        # string: its rows' type, "f16" / "q8_0" (absent: f16)
        KV_HEAVY = "pykvq.cache.kv_heavy"                    # float32: default heavy hitters, a fraction of the context

        TYPE = {"k": TYPE_K, "v": TYPE_V}
        LAYER_TYPES = {"k": LAYER_TYPES_K, "v": LAYER_TYPES_V}
        CODEBOOK_ROT = {"k": CODEBOOK_ROT_K, "v": CODEBOOK_ROT_V}

    class Baked:
        """Transforms baked into the weights."""
        KSORT = "pykvq.baked.ksort"                          # bool; the runtime turns the online K rotation off
        KSORT_KEY = "pykvq.baked.ksort_key"
        SMOOTH_QK = "pykvq.baked.smooth_qk"
        SMOOTH_ALPHA = "pykvq.baked.smooth_alpha"            # [f32] per layer, -1 = none
        ROTATE_V = "pykvq.baked.rotate_v"                    # Values.ROTATE_V_*; the runtime turns the online V rotation off
        ROTATE_V_LAYERS = "pykvq.baked.rotate_v_layers"      # [str] per layer: learned / hadamard
        ROTATE_V_COND = "pykvq.baked.rotate_v_cond"          # [f32] per layer
        LEARN_K = "pykvq.baked.learn_k"
        LEARN_K_LAYERS = "pykvq.baked.learn_k_layers"

    class Rope:
        LAYOUT = "pykvq.rope.layout"                         # Values.ROPE_LAYOUT_NORM: NEOX re-laid as NORM

    class Calib:
        SOURCE = "pykvq.calib.source"                        # informative: the calibration text


class Values:
    """String values of the keys above that code compares against."""
    K_DOMAIN_PREROPE = "prerope"
    K_DOMAIN_POSTROPE = "postrope"
    ROPE_LAYOUT_NORM = "norm"
    ROTATE_V_NONE = "none"
    ROTATE_V_HADAMARD = "hadamard"
    ROTATE_V_LEARNED = "learned"


class Tensors:
    """Per-layer tensor names: template.format(bid=layer)."""
    ROPE_FREQS = "blk.{bid}.kvq_rope_freqs"                  # F32 [n_rot/2, n_head_kv]: K-sorted pair frequencies
    CODEBOOK_K = "blk.{bid}.kvq_codebook_k"                  # I8 [16]: nuq codebook of the K / V cache
    CODEBOOK_V = "blk.{bid}.kvq_codebook_v"
    K_MEAN = "blk.{bid}.kvq_k_mean"                          # F32 [head_dim, n_head_kv]: pre-RoPE key cache
    K_SCALE = "blk.{bid}.kvq_k_scale"
    K_STD = "blk.{bid}.kvq_k_std"                            # F32, same shape: the keys' std (scale methods but std)
    Q_MEAN = "blk.{bid}.kvq_q_mean"                          # F32, same shape: the mean pre-RoPE query, summed over
                                                             # each KV head's group (the heavy-hitter score's direction)

    CODEBOOK = {"k": CODEBOOK_K, "v": CODEBOOK_V}


def suffix(template: str) -> str:
    """A tensor name template without its "blk.{bid}." prefix: suffix(Tensors.ROPE_FREQS) == "kvq_rope_freqs"."""
    return template.split("{bid}.", 1)[1]
