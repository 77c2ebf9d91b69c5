#pragma once

// pykvq's public C API on top of llama.h. llama.h itself stays byte-for-byte upstream's, so bindings built
// against upstream (llama-cpp-python's ctypes structs among them) load this library unchanged; every
// pykvq setting goes through the llama_kvq_* functions below.

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// type_k / type_v value meaning "what the GGUF's pykvq.cache.type_k/v (or layer_types_k/v) asks for, else f16"
#define LLAMA_KV_CACHE_TYPE_MODEL GGML_TYPE_COUNT

// online Hadamard rotation of the K / V cache (upstream: only the LLAMA_ATTN_ROT_DISABLE environment variable)
enum llama_attn_rot_type {
    LLAMA_ATTN_ROT_TYPE_AUTO     = -1, // upstream's rule, unless the GGUF's baked transforms turn it off
    LLAMA_ATTN_ROT_TYPE_DISABLED = 0,
    LLAMA_ATTN_ROT_TYPE_ENABLED  = 1,
};

// llama_init_from_model with pykvq's per-context settings (llama_init_from_model takes the process default)
LLAMA_API struct llama_context * llama_kvq_init_from_model(
        struct llama_model * model, struct llama_context_params params,
        enum llama_attn_rot_type attn_rot_k, enum llama_attn_rot_type attn_rot_v);

// the rotation of contexts created later in this process by llama_init_from_model (the tools' -rotk / -rotv)
LLAMA_API void llama_kvq_set_default_attn_rot(enum llama_attn_rot_type attn_rot_k, enum llama_attn_rot_type attn_rot_v);

// ggml type id of layer il's K (v = false) or V cache, -1 if the layer has no KV cache
LLAMA_API int32_t llama_kvq_layer_type(const struct llama_context * ctx, int32_t il, bool v);

// where layer il's K / V nuq codebook comes from: 0 not a nuq cache, 1 the model file, 2 the type's fallback
LLAMA_API int32_t llama_kvq_codebook_source(const struct llama_context * ctx, int32_t il, bool v);

// entries of the GGUF's per-layer cache types pykvq.cache.layer_types_k (v = false) / _v, 0 when absent
LLAMA_API int32_t llama_kvq_model_n_layer_types(const struct llama_model * model, bool v);

// whether the online Hadamard rotation of the K (v = false) or V cache is on: 1 on, 0 off, -1 no KV cache
LLAMA_API int32_t llama_kvq_attn_rot(const struct llama_context * ctx, bool v);

// cells of the context's attention KV caches in use: those holding sequence seq_id, or with seq_id < 0 those any
// sequence holds. Summed over every stream (a non-unified cache has one per sequence) and every attention cache of
// the memory (an iSWA memory's base and SWA caches both); a cell shared by copied sequences counts once in the
// total. -1 when the context has no attention KV cache or seq_id is out of range.
LLAMA_API int32_t llama_kvq_memory_used_cells(const struct llama_context * ctx, llama_seq_id seq_id);

#ifdef __cplusplus
}
#endif
