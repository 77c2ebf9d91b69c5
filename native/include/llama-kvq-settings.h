#pragma once

// pykvq: a context's settings as the library holds them once resolved (the table and its parsers:
// native/llama/llama-kvq.cpp)

#include "llama-kvq-api.h"

// the default of the k_centre_residual setting (llama_kvq_centre_pairs)
#define LLAMA_KVQ_CENTRE_RESIDUAL 0.5

// pykvq's per-context settings (native/llama/llama-kvq.cpp, the table behind llama_kvq_params_set). llama_context_params
// has no room for them: they come from llama_kvq_init_from_model_params, else the process default
// (llama_kvq_set_default: the tools' flags), resolved once per context and passed down to its caches
enum llama_kvq_k_domain {
    LLAMA_KVQ_K_DOMAIN_AUTO    = -1, // the file's: pre-RoPE for the quantized K layers of a --prerope-k file
    LLAMA_KVQ_K_DOMAIN_POST    = 0,
    LLAMA_KVQ_K_DOMAIN_PRE     = 1,  // every layer, an f16 K cache too (for equivalence tests)
    LLAMA_KVQ_K_DOMAIN_CENTRED = 2,  // quantized K layers after RoPE, minus the file's mean rotated with them
};
struct llama_kvq_ctx_opts {
    llama_attn_rot_type attn_rot_k = LLAMA_ATTN_ROT_TYPE_AUTO;
    llama_attn_rot_type attn_rot_v = LLAMA_ATTN_ROT_TYPE_AUTO;
    int    k_domain        = LLAMA_KVQ_K_DOMAIN_AUTO;
    int    encoder         = -1;     // -1 auto, else GGML_KVQ_ENCODER_STOCK / _LSQ
    double centre_residual = LLAMA_KVQ_CENTRE_RESIDUAL;
    int    kv_window       = -1;     // exact window: the last cells written kept in f16 (-1: not set, 0)
    int    kv_sinks        = -1;     // and the first positions (attention sinks) (-1: not set, 0)
    int    kv_window_type  = -1;     // the type its rows are held in: GGML_TYPE_F16 / GGML_TYPE_Q8_0 (-1: not set)
    double kv_heavy        = -1.0;   // and this fraction of each sequence's cells, the heavy hitters (-1: not set, 0)
};

// llama_init_from_model with these settings: a C++ overload holding upstream's body (src/llama-context.cpp, the KV cache
// seam); the C entry point passes the process default. The context's constructor hands them to llama_kvq_init_memory
struct llama_context;
llama_context * llama_init_from_model(llama_model * model, llama_context_params params, llama_kvq_ctx_opts opts);
