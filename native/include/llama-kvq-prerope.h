#pragma once

// pykvq: the llama side of the pre-RoPE and centred key caches (native/llama/llama-kvq-prerope.cpp): what the cache
// stores, what flash attention is given to turn it back, and the online K rotation's layout for keys in halves.

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-kvq.h"

#include <cstdint>
#include <string>
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
int llama_kvq_centre_pairs(std::vector<float> & mean, const std::vector<float> & var, int64_t DK, int64_t n_head_kv,
                           int n_dims, bool neox, double residual);

// put positions (I32 [n_kv, n_stream]) and fa on the layer's FLASH_ATTN_EXT node (k_rot: the online Hadamard
// the stored K was turned by, llama_kvq_new_k_rot's tensor, nullptr for none); throws when fa_node is not one
void llama_kvq_prerope_attach(ggml_tensor * fa_node, ggml_tensor * pos, const llama_kvq_prerope_fa & fa,
                              const ggml_tensor * k_rot);

// make the graph inputs put on fa_node after it joined gf (positions, frequencies, a centred mean) leafs of gf: the
// scheduler then keeps them in host memory and copies them into the node's split once its backend is idle
void llama_kvq_fa_inputs_to_graph(ggml_cgraph * gf, ggml_tensor * fa_node);

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
// The online V Hadamard's size: upstream's 64, or the widest block of a layer's V type past it (tcq*_128 keeps one
// scale per 128 values, which the 64-wide turn leaves at two different magnitudes); nrot divides every head it turns.
template <typename Layer>
int64_t llama_kvq_v_rot_size(const std::vector<Layer> & layers, int64_t nrot) {
    int64_t n = nrot;
    for (const auto & l : layers) {
        if (l.v != nullptr && ggml_kvq_type_is_kvq(l.v->type) && ggml_blck_size(l.v->type) > n) {
            n = ggml_blck_size(l.v->type);
        }
    }
    return n;
}
// the butterfly stride the K rotation tensor leaves out (0: none; nullptr: no rotation)
int llama_kvq_k_rot_skip(const ggml_tensor * k_rot);
// fills a host K rotation tensor that leaves a stride out and returns true; false for upstream's plain Hadamard
bool llama_kvq_k_rot_fill(ggml_tensor * k_rot);
