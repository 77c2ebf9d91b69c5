#pragma once

// pykvq: the llama side of the cache types (libllama; native/llama/llama-kvq*.cpp): per-context settings, the cache
// types and codebooks a file asks for, the pre-RoPE / centred key cache, session states, what a context holds.
//
// Codebooks: a nuq cache tensor is dequantized through a per-layer int8 codebook; every graph node that writes or reads
// one (SET_ROWS, CPY, GET_ROWS, MUL_MAT, FLASH_ATTN_EXT) is told which codebook to use, nullptr meaning the
// type's fallback codebook. The helpers are no-ops for other types.

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-kvq.h"
#include "llama-kvq-api.h"

#include <cstdint>
#include <cstring>
#include <string>

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

// pykvq: the pre-RoPE key cache (native/llama/llama-kvq-prerope.cpp)
#include <vector>

// what one layer's FLASH_ATTN_EXT needs besides the cell positions
struct llama_kvq_prerope_fa {
    ggml_tensor * mean  = nullptr;      // model tensors blk.N.kvq_k_mean / kvq_k_scale, F32 [DK, n_head_kv]
    ggml_tensor * scale = nullptr;
    ggml_tensor * freqs = nullptr;      // graph input F32 [n_dims/2, n_head_kv], filled from freqs_host
    std::vector<float> freqs_host;
    int   n_dims = 0;
    int   mode   = 0;
    float mscale = 1.0f;
    bool  centred = false;              // a centred post-RoPE layer: mean is a graph input (the kept pairs)
};

// why a layer cannot have a pre-RoPE key cache (nullptr: it can)
const char * llama_kvq_prerope_unsupported(int rope_type, bool has_rope, bool is_mla);

// "" when a pre-RoPE key cache offloaded to dev has kernels there (CUDA's, native/ggml/cuda/kvq-prerope.cuh, or an RPC
// worker whose HELLO says its backends have them), else the error the context raises, naming the device and the ways out
// (centred: the centred post-RoPE cache, whose kernels are the CPU's only)
std::string llama_kvq_prerope_device_unsupported(ggml_backend_dev_t dev, bool centred);

// the file's statistics of layer il, checked once when the context turns the layer pre-RoPE: F32, finite,
// scale > 0; throws std::runtime_error naming the tensor and element otherwise
void llama_kvq_prerope_check_stats(const ggml_tensor * mean, const ggml_tensor * scale, int il);

// k_rope: the model graph's K (a ROPE node). Returns what the cache stores, (k_pre - mean) / scale, and fills
// fa from the node's RoPE parameters. Throws std::runtime_error for a graph it cannot honour.
ggml_tensor * llama_kvq_prerope_store(ggml_context * ctx, ggml_tensor * k_rope, ggml_tensor * mean, ggml_tensor * scale,
                                      llama_kvq_prerope_fa & fa, int il);

// the centred post-RoPE cache (k_domain = centred): the same ROPE node applied to k_pre - centre, centre being
// the layer's kept mean pairs (F32 [DK, n_head_kv] host values, a graph input fa.mean filled from them)
ggml_tensor * llama_kvq_centred_store(ggml_context * ctx, ggml_tensor * k_rope, const std::vector<float> & centre,
                                      llama_kvq_prerope_fa & fa, int il);

// the pairs of a head's mean a centred cache keeps: by energy m_a^2 + m_b^2, the fewest that leave a residual
// mean energy of at most residual (the k_centre_residual setting) x the head's summed variance var (the per-token spread a
// quantizer covers anyway; empty var: every pair with a mean); the others are zeroed. mean, var: [n_head_kv][DK]
#define LLAMA_KVQ_CENTRE_RESIDUAL 0.5
int llama_kvq_centre_pairs(std::vector<float> & mean, const std::vector<float> & var, int64_t DK, int64_t n_head_kv,
                           int n_dims, bool neox, double residual);

// put positions (I32 [n_kv, n_stream]) and fa on the layer's FLASH_ATTN_EXT node (k_rot: the online Hadamard
// the stored K was turned by, llama_kvq_new_k_rot's tensor, nullptr for none); throws when fa_node is not one
void llama_kvq_prerope_attach(ggml_tensor * fa_node, ggml_tensor * pos, const llama_kvq_prerope_fa & fa,
                              const ggml_tensor * k_rot);

// make the graph inputs put on fa_node after it joined gf (positions, frequencies, a centred mean) leafs of gf: the
// scheduler then keeps them in host memory and copies them into the node's split once its backend is idle
void llama_kvq_fa_inputs_to_graph(ggml_cgraph * gf, ggml_tensor * fa_node);

// session states: each layer's K / V type word also says what else decodes the bytes: a pre-RoPE K layer sets
// LLAMA_KVQ_STATE_PREROPE, a centred one LLAMA_KVQ_STATE_CENTRED, a cache turned by upstream's online Hadamard (attn_rot_k / attn_rot_v) sets
// LLAMA_KVQ_STATE_ROT, a file codebook puts its fingerprint (1..255) in bits 20..27 (type ids stay far below)
#define LLAMA_KVQ_STATE_PREROPE  0x10000
#define LLAMA_KVQ_STATE_ROT      0x20000
#define LLAMA_KVQ_STATE_CENTRED  0x40000
#define LLAMA_KVQ_STATE_CB_SHIFT 20
// a stream's v_trans word: its exact-window rows follow its V rows (llama-kvq-window.cpp)
#define LLAMA_KVQ_STATE_WINDOW   0x10000

// the type word a state records for a layer's cache tensor (native/llama/llama-kvq-memory.cpp)
int32_t     llama_kvq_state_type_word(ggml_type type, const int8_t * cb, int k_domain /* 0 post, 1 pre, 2 centred */, bool rot);
// "" when a state's word (have) fits this context's (want), else why not, naming K or V
std::string llama_kvq_state_mismatch(int32_t have, int32_t want, char which);

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
};

// the exact window of a pre-RoPE key cache (native/llama/llama-kvq-window.cpp)
struct llama_kvq_window;
// planes 1-3 of the positions input at cell j of stream strm, as this batch's attention reads them: the cell's row in
// the layers' window tensors (-1: its quantized row), the last query position reading that row, query j's position
void llama_kvq_window_planes(const llama_kvq_window & w, uint32_t strm, uint32_t j, int32_t * row, int32_t * last, int32_t * qpos);

// llama_init_from_model with these settings: a C++ overload holding upstream's body (src/llama-context.cpp, the KV cache
// seam); the C entry point passes the process default. The context's constructor hands them to llama_kvq_init_memory
struct llama_context;
llama_context * llama_init_from_model(llama_model * model, llama_context_params params, llama_kvq_ctx_opts opts);

// pykvq in llama's memories (native/llama/llama-kvq-memory.cpp)
#include <functional>
#include <string>

struct llama_model;
struct llama_memory_i;
struct gguf_context;
class llama_kv_cache;

// what one model layer's attention cache holds
struct llama_kvq_layer_desc {
    int32_t  type_k = -1;     // ggml type of the K / V cache tensor, -1 when the layer has none
    int32_t  type_v = -1;
    int32_t  cb_k   = 0;      // codebook: 0 not a nuq cache, 1 from the file, 2 the type's fallback
    int32_t  cb_v   = 0;
    bool     rot_k  = false;  // the online Hadamard rotation of the cache holding the layer
    bool     rot_v  = false;
    uint32_t n_embd_k_gqa = 0;
    uint32_t n_embd_v_gqa = 0;
    int32_t  il_owner = -1;   // the layer whose cache tensors these are (differs for a layer that reuses another's)
    bool     host_k = true;   // the K cache tensor is in host memory (a CPU buffer)
    int32_t  k_domain = LLAMA_KVQ_K_DOMAIN_POST;  // where the layer's keys are cached
    int32_t  encoder  = GGML_KVQ_ENCODER_STOCK;   // the q4_0 / q5_0 writes' encoder of the cache holding the layer
};

// one entry per model layer [0, n_layer) for every attention KV cache a memory holds (plain, iSWA, hybrid)
std::vector<llama_kvq_layer_desc> llama_memory_kvq_layers(const llama_memory_i * mem, uint32_t n_layer);

// key domain of the memory's attention caches: pre-RoPE for the layers the file's pykvq.cache.k_domain,
// statistics and the cache type allow (PYKVQ_K_DOMAIN=post keeps every layer post-RoPE). Returns the layer count.
uint32_t llama_memory_kvq_set_k_domain(llama_memory_i * mem, const llama_kvq_ctx_opts & opts, uint32_t n_ubatch);

// apply llama_kvq_cache::set_attn_rot to every attention KV cache a memory holds
void llama_memory_set_attn_rot(llama_memory_i * mem, llama_attn_rot_type rot_k, llama_attn_rot_type rot_v);

// calls f on every attention KV cache a memory holds (plain, iSWA base and SWA, hybrid); returns how many
int llama_kvq_for_each_kv_cache(llama_memory_i * mem, const std::function<void(llama_kv_cache &)> & f);

// llama_kvq_memory_used_cells on a memory: -1 when it holds no attention KV cache or seq_id >= its n_seq_max
int32_t llama_memory_kvq_used_cells(llama_memory_i * mem, llama_seq_id seq_id);

// The online K Hadamard's input tensor [nrot, nrot] (upstream: nrot = the largest power of two dividing the head
// size). A q53_64 (q42_64) block's halves hold 5- and 3-bit (4- and 2-bit) values of channels of different
// importance (pykvq/ref/q53.py), so with any such K layer the rotation never mixes the halves: within each
// 32-value half for nrot 64, and for nrot >= 128 the Hadamard without its stride-32 butterfly
// (ggml_kvq_fa_set_hadamard_skip), which turns the wide halves of nrot/64 blocks together and their narrow halves
// together. That layout is marked in the tensor's
// op_params (llama_kvq_k_rot_skip) for llama_kvq_k_rot_fill and llama_kvq_prerope_attach.
#define LLAMA_KVQ_K_ROT_MIN 32
ggml_tensor * llama_kvq_new_k_rot_tensor(ggml_context * ctx, bool q53, int64_t nrot);
// whether any layer's K cache is of a halves type (q53_64, q42_64)
template <typename Layer>
bool llama_kvq_halves_k(const std::vector<Layer> & layers) {
    for (const auto & l : layers) {
        if (l.k != nullptr && ggml_kvq_type_family(l.k->type) == GGML_KVQ_FAMILY_Q53) {
            return true;
        }
    }
    return false;
}
template <typename Layer>
ggml_tensor * llama_kvq_new_k_rot(ggml_context * ctx, const std::vector<Layer> & layers, int64_t nrot) {
    return llama_kvq_new_k_rot_tensor(ctx, llama_kvq_halves_k(layers), nrot);
}
// the butterfly stride the K rotation tensor leaves out (0: none; nullptr: no rotation)
int llama_kvq_k_rot_skip(const ggml_tensor * k_rot);
// fills a host K rotation tensor that leaves a stride out and returns true; false for upstream's plain Hadamard
bool llama_kvq_k_rot_fill(ggml_tensor * k_rot);

// throws when a K cache of a type with CPU kernels only (cuda = 0 in ggml-kvq-types.h; none at present) is in a device
// buffer (CUDA, RPC, ...), where writing it would abort in the scheduler: the error names the way out
void llama_kvq_check_cache_devices(const llama_model & model, const llama_memory_i * mem);

// logs what a context's caches hold: types per layer when they differ, bits/value, codebook sources
void llama_kvq_log_cache(const llama_model & model, const llama_memory_i * mem);

// the llama_context constructor's hooks (patches: one call each). After the memory is made: this context's
// rotation, encoder and key domain (opts: its settings, nullptr for the defaults), then the device checks and the cache
// log; throws when a device cannot run what the cache holds. mem may be null (no KV cache)
void llama_kvq_init_memory(const llama_model & model, llama_memory_i * mem, const llama_kvq_ctx_opts * opts, bool offload_kqv,
                           uint32_t n_ubatch);
// without flash attention: a quantized V layer, or a pykvq K type on a GPU (K·Q would be a CPU MUL_MAT), throws
void llama_kvq_check_without_flash_attn(const llama_model & model, const llama_memory_i * mem, bool offload_kqv);

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
