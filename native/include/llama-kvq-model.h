#pragma once

// pykvq: what a converted GGUF asks of its KV cache, held by llama_model as its one `kvq` member (the model loading
// and keys seam): per-layer cache types and the host copies of the nuq codebooks. Filled by llama_kvq_load_cache_keys
// and llama_kvq_load_codebooks (native/llama/llama-kvq-model.cpp), which hold the bodies of its functions too.

#include "ggml.h"
#include "llama.h"

#include <array>
#include <cstdint>
#include <vector>

// index 0 = K, 1 = V
struct llama_kvq_model_info {
    std::vector<ggml_type> layer_types[2];                                // pykvq.cache.layer_types_k/v (empty when absent)
    ggml_type              file_type[2] = { GGML_TYPE_COUNT, GGML_TYPE_COUNT }; // pykvq.cache.type_k/v, COUNT when absent
    std::vector<std::array<int8_t, 16>> codebook[2];                      // [n_layer] blk.N.kvq_codebook_k/v, host copies
    std::vector<uint8_t>   has_codebook[2];                               // [n_layer]
    int                    codebook_rot[2] = { -1, -1 };                  // pykvq.cache.codebook_rot_k/v: -1 absent, 0 off, 1 on
    bool                   k_prerope = false;                             // pykvq.cache.k_domain = prerope

    // the type layer il's K (v = false) or V cache gets when the context asks for `requested`:
    // LLAMA_KV_CACHE_TYPE_MODEL takes the layer's pykvq.cache.layer_types_k/v entry, else pykvq.cache.type_k/v, else f16
    ggml_type cache_type(ggml_type requested, uint32_t il, bool v) const;
    // the type layer il's codebook was calibrated for (GGML_TYPE_COUNT when the file does not say)
    ggml_type calibrated_type(uint32_t il, bool v) const;
    // the file's codebook for layer il when its cache runs as `type` (a nuq type it was calibrated for), else nullptr (fallback)
    const int8_t * codebook_for(uint32_t il, bool v, ggml_type type) const;
};

struct llama_model;
struct gguf_context;
struct llama_kvq_ctx_opts;

// what a converted GGUF asks for (native/llama/llama-kvq-model.cpp)
void llama_kvq_load_cache_keys(llama_model & model, const gguf_context * ctx);  // pykvq.cache.* keys
void llama_kvq_load_codebooks(llama_model & model);                              // host copies of blk.N.kvq_codebook_k/v
// the file's codebook for layer il's K / V cache of `type` (nullptr: none, or not the type it was calibrated for);
// throws std::runtime_error naming the tensor when it is not a valid codebook of that type
const int8_t * llama_kvq_layer_codebook(const llama_model & model, int il, bool v, ggml_type type);
// fills what the caller left open (cache types, rotation) from the file's keys and logs where each came from
void llama_kvq_apply_model_defaults(const llama_model & model, llama_context_params & params, llama_kvq_ctx_opts & kvq);
// upstream's cache-type checks of llama_init_from_model, for every layer's own type (a file's per-layer types when
// type_k / type_v is LLAMA_KV_CACHE_TYPE_MODEL): MLA's equal K / V types, flash attention for a quantized V (turned
// on when auto), block sizes that divide the head. False (logged) refuses the context.
bool llama_kvq_check_cache_types(const llama_model & model, llama_context_params & params);
