#pragma once

// pykvq's GGUF metadata keys, their values and per-layer tensor names (printf templates, %d = the layer).
// Mirror of pykvq/keys.py (Keys.<Class>.<NAME> -> LLAMA_KVQ_KEY_<CLASS>_<NAME>, Values.<NAME> ->
// LLAMA_KVQ_VALUE_<NAME>, Tensors.<NAME> -> LLAMA_KVQ_TENSOR_<NAME>); tests/test_keys.py checks that the two
// agree. The converter writes these and files already converted carry them: never rename one.

// Keys.General
#define LLAMA_KVQ_KEY_GENERAL_VERSION          "pykvq.version"

// Keys.Cache: what the cache of a converted file is prepared for
#define LLAMA_KVQ_KEY_CACHE_TYPE_K             "pykvq.cache.type_k"
#define LLAMA_KVQ_KEY_CACHE_TYPE_V             "pykvq.cache.type_v"
#define LLAMA_KVQ_KEY_CACHE_LAYER_TYPES_K      "pykvq.cache.layer_types_k"
#define LLAMA_KVQ_KEY_CACHE_LAYER_TYPES_V      "pykvq.cache.layer_types_v"
#define LLAMA_KVQ_KEY_CACHE_CODEBOOK_METHOD    "pykvq.cache.codebook_method"
#define LLAMA_KVQ_KEY_CACHE_CODEBOOK_QNORM     "pykvq.cache.codebook_qnorm"
#define LLAMA_KVQ_KEY_CACHE_CODEBOOK_ROT_K     "pykvq.cache.codebook_rot_k"
#define LLAMA_KVQ_KEY_CACHE_CODEBOOK_ROT_V     "pykvq.cache.codebook_rot_v"
#define LLAMA_KVQ_KEY_CACHE_K_DOMAIN           "pykvq.cache.k_domain"
#define LLAMA_KVQ_KEY_CACHE_K_SCALE_METHOD     "pykvq.cache.k_scale_method"
#define LLAMA_KVQ_KEY_CACHE_KV_SINKS           "pykvq.cache.kv_sinks"
#define LLAMA_KVQ_KEY_CACHE_KV_WINDOW          "pykvq.cache.kv_window"
#define LLAMA_KVQ_KEY_CACHE_KV_WINDOW_TYPE     "pykvq.cache.kv_window_type"
#define LLAMA_KVQ_KEY_CACHE_KV_HEAVY           "pykvq.cache.kv_heavy"

// Keys.Baked: transforms baked into the weights
#define LLAMA_KVQ_KEY_BAKED_KSORT              "pykvq.baked.ksort"
#define LLAMA_KVQ_KEY_BAKED_KSORT_KEY          "pykvq.baked.ksort_key"
#define LLAMA_KVQ_KEY_BAKED_SMOOTH_QK          "pykvq.baked.smooth_qk"
#define LLAMA_KVQ_KEY_BAKED_SMOOTH_ALPHA       "pykvq.baked.smooth_alpha"
#define LLAMA_KVQ_KEY_BAKED_ROTATE_V           "pykvq.baked.rotate_v"
#define LLAMA_KVQ_KEY_BAKED_ROTATE_V_LAYERS    "pykvq.baked.rotate_v_layers"
#define LLAMA_KVQ_KEY_BAKED_ROTATE_V_COND      "pykvq.baked.rotate_v_cond"
#define LLAMA_KVQ_KEY_BAKED_LEARN_K            "pykvq.baked.learn_k"
#define LLAMA_KVQ_KEY_BAKED_LEARN_K_LAYERS     "pykvq.baked.learn_k_layers"

// Keys.Rope, Keys.Calib
#define LLAMA_KVQ_KEY_ROPE_LAYOUT              "pykvq.rope.layout"
#define LLAMA_KVQ_KEY_CALIB_SOURCE             "pykvq.calib.source"

// Values
#define LLAMA_KVQ_VALUE_K_DOMAIN_PREROPE       "prerope"
#define LLAMA_KVQ_VALUE_K_DOMAIN_POSTROPE      "postrope"
#define LLAMA_KVQ_VALUE_ROPE_LAYOUT_NORM       "norm"
#define LLAMA_KVQ_VALUE_ROTATE_V_NONE          "none"
#define LLAMA_KVQ_VALUE_ROTATE_V_HADAMARD      "hadamard"
#define LLAMA_KVQ_VALUE_ROTATE_V_LEARNED       "learned"

// Tensors (per layer)
#define LLAMA_KVQ_TENSOR_ROPE_FREQS            "blk.%d.kvq_rope_freqs"
#define LLAMA_KVQ_TENSOR_CODEBOOK_K            "blk.%d.kvq_codebook_k"
#define LLAMA_KVQ_TENSOR_CODEBOOK_V            "blk.%d.kvq_codebook_v"
#define LLAMA_KVQ_TENSOR_K_MEAN                "blk.%d.kvq_k_mean"
#define LLAMA_KVQ_TENSOR_K_SCALE               "blk.%d.kvq_k_scale"
#define LLAMA_KVQ_TENSOR_K_STD                 "blk.%d.kvq_k_std"
#define LLAMA_KVQ_TENSOR_Q_MEAN                "blk.%d.kvq_q_mean"
