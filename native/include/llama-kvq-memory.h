#pragma once

// pykvq in llama's memories (native/llama/llama-kvq-memory.cpp): every attention KV cache a memory holds, what each
// layer's cache holds, the settings applied to a context's caches, its log line and device checks.

#include "ggml-kvq.h"
#include "llama-kvq-settings.h"

#include <cstdint>
#include <functional>
#include <vector>

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
