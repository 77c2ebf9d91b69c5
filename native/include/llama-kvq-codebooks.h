#pragma once

// pykvq: cache types and codebooks on graph nodes (libllama). A nuq cache tensor is dequantized through a per-layer
// int8 codebook; every graph node that writes or reads one (SET_ROWS, CPY, GET_ROWS, MUL_MAT, FLASH_ATTN_EXT) is told
// which codebook to use, nullptr meaning the type's fallback codebook. The helpers are no-ops for other types.

#include "ggml.h"
#include "ggml-kvq.h"

#include <cstdint>
#include <cstring>

static inline bool llama_kvq_is_nuq(ggml_type type) {
    return (int) type >= 0 && type < GGML_TYPE_COUNT && ggml_kvq_is_nuq(type);
}

// tell a node that writes or reads a cache tensor of `type` which codebook to use (no-op unless the type is nuq)
static inline ggml_tensor * llama_kvq_set_codebook(ggml_tensor * node, ggml_type type, const int8_t * cb) {
    if (node != nullptr && llama_kvq_is_nuq(type)) {
        ggml_kvq_set_codebook(node, cb);
    }
    return node;
}

// tell a cache write (SET_ROWS) which encoder to use: GGML_KVQ_ENCODER_LSQ takes least-squares block scales where the
// cache is q4_0 / q5_0 (the stock format either way; a no-op for other types)
static inline ggml_tensor * llama_kvq_set_encoder(ggml_tensor * node, int encoder) {
    if (node != nullptr && encoder == GGML_KVQ_ENCODER_LSQ && (node->type == GGML_TYPE_Q4_0 || node->type == GGML_TYPE_Q5_0)) {
        ggml_kvq_set_encoder(node, encoder);
    }
    return node;
}

// the same for a FLASH_ATTN_EXT node over K of type_k and V of type_v
static inline void llama_kvq_set_codebooks_fa(ggml_tensor * fa, ggml_type type_k, const int8_t * cb_k, ggml_type type_v, const int8_t * cb_v) {
    if (llama_kvq_is_nuq(type_k) || llama_kvq_is_nuq(type_v)) {
        ggml_kvq_set_codebooks_fa(fa, llama_kvq_is_nuq(type_k) ? cb_k : nullptr, llama_kvq_is_nuq(type_v) ? cb_v : nullptr);
    }
}

// entries of a nuq type's codebook (16 / 8 / 4), 0 for other types
static inline int llama_kvq_n_codes(ggml_type type) {
    return llama_kvq_is_nuq(type) ? ggml_kvq_nuq_n_codes(type) : 0;
}

// a codebook the nuq kernels accept: n_codes entries, strictly ascending, in [-127, 127]
static inline bool llama_kvq_codebook_ok(const int8_t * cb, ggml_type type) {
    const int n = llama_kvq_n_codes(type);
    return cb != nullptr && n > 0 && ggml_kvq_nuq_codebook_ok(cb, n);
}

// parse a ggml type name ("q8_0", "nuq3", ...); GGML_TYPE_COUNT when this build does not know it
static inline ggml_type llama_kvq_type_from_name(const char * name) {
    for (int t = 0; t < GGML_TYPE_COUNT && name != nullptr && *name; ++t) {
        const char * tn = ggml_type_name((ggml_type) t);
        if (tn != nullptr && ggml_type_size((ggml_type) t) > 0 && strcmp(tn, name) == 0) {
            return (ggml_type) t;
        }
    }
    return GGML_TYPE_COUNT;
}
