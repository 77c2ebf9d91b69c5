// pykvq: the llama side of the pre-RoPE key cache (the ggml side: ggml-kvq.h, "Pre-RoPE key cache").
//
// The model graph builds K as ROPE(k_pre, positions, factors). For a pre-RoPE layer the cache stores
// (k_pre - mean) / scale instead, and flash attention applies this very ROPE node's rotation when it
// reads a K tile: its parameters (mode, n_dims, base, scale, YaRN, attn_factor, factors) are taken from
// the node, so every rope variant a model graph uses is honoured, or refused here with a clear error.
#include "llama-kvq-prerope.h"

#include "ggml-backend.h"
#include "ggml-kvq-rpc.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

static std::string kvq_layer(int il) {
    return "pre-RoPE key cache, layer " + std::to_string(il) + ": ";
}

const char * llama_kvq_prerope_unsupported(int rope_type, bool has_rope, bool is_mla) {
    if (!has_rope) {
        return "the layer has no RoPE";
    }
    if (is_mla) {
        return "MLA caches are not supported";
    }
    if (rope_type != GGML_ROPE_TYPE_NORMAL && rope_type != GGML_ROPE_TYPE_NEOX) {
        return "only NORM and NEOX RoPE are supported (not M-RoPE / vision)";
    }
    return nullptr;
}

std::string llama_kvq_prerope_device_unsupported(ggml_backend_dev_t dev, bool centred) {
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    const char * backend = reg ? ggml_backend_reg_name(reg) : "?";
    const uint8_t caps = ggml_kvq_dev_caps(dev);   // an RPC worker's: what its HELLO said its backends run
    if (strcmp(backend, "RPC") == 0) {
        backend = "this RPC worker's backend";
    }
    if (centred && !(caps & GGML_KVQ_RPC_CENTRED)) {
        return std::string("the centred key cache (--kv-domain centred) has kernels for CPU and CUDA only, not for ") + backend + " (device " +
               ggml_backend_dev_name(dev) + "): keep the KV cache on the CPU (-nkvo / offload_kqv = false), or use --kv-domain pre";
    }
    if (!centred && !(caps & GGML_KVQ_RPC_PREROPE)) {
        return std::string("the pre-RoPE key cache has kernels for CPU and CUDA only, not for ") + backend + " (device " +
               ggml_backend_dev_name(dev) + "): run with --kv-domain post (post-RoPE keys), or keep the KV cache on the "
               "CPU (-nkvo / offload_kqv = false)";
    }
    return "";
}

void llama_kvq_prerope_check_stats(const ggml_tensor * mean, const ggml_tensor * scale, int il) {
    for (const ggml_tensor * t : { mean, scale }) {
        if (t->type != GGML_TYPE_F32) {
            throw std::runtime_error(kvq_layer(il) + t->name + " must be F32, not " + ggml_type_name(t->type));
        }
        if (t->data == nullptr || t->buffer == nullptr) {
            continue; // a model loaded without its weights (the tools' -fit probe): the real context checks them
        }
        std::vector<float> v(ggml_nelements(t));
        ggml_backend_tensor_get(t, v.data(), 0, ggml_nbytes(t));
        // the cache holds (k - mean) / scale in f16 or a type with f16 block scales: a mean or scale outside f16's
        // normal range turns it into inf / 0 (a silent wrong load), so such a file is refused
        for (size_t i = 0; i < v.size(); ++i) {
            const bool ok = t == scale ? v[i] >= 0x1p-14f && v[i] <= 65504.0f : std::fabs(v[i]) <= 65504.0f;
            if (!ok) {
                char val[32];
                snprintf(val, sizeof(val), "%g", v[i]);
                throw std::runtime_error(kvq_layer(il) + t->name + "[" + std::to_string(i) + "] = " + val +
                                         (t == scale ? ": must be finite and > 0, in f16's normal range [6.1e-05, 65504]"
                                                     : ": a mean must be finite, |mean| <= 65504"));
            }
        }
    }
}

// fa's rotation (frequencies, n_dims, mode, mscale) from the model graph's K ROPE node; checks what a kernel needs
static void kvq_rope_of(ggml_context * ctx, const ggml_tensor * k_rope, llama_kvq_prerope_fa & fa, int il) {
    if (k_rope->op != GGML_OP_ROPE) {
        throw std::runtime_error(kvq_layer(il) + "the model graph's K is not the output of a ROPE op (" +
                                 ggml_op_name(k_rope->op) + "); this architecture needs the post-RoPE cache (--kv-domain post)");
    }
    const int32_t * p = k_rope->op_params;
    const int n_dims = p[1], mode = p[2], n_ctx_orig = p[4];
    float freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow;
    memcpy(&freq_base,   p +  5, sizeof(float));
    memcpy(&freq_scale,  p +  6, sizeof(float));
    memcpy(&ext_factor,  p +  7, sizeof(float));
    memcpy(&attn_factor, p +  8, sizeof(float));
    memcpy(&beta_fast,   p +  9, sizeof(float));
    memcpy(&beta_slow,   p + 10, sizeof(float));
    if (mode != GGML_ROPE_TYPE_NORMAL && mode != GGML_ROPE_TYPE_NEOX) {
        throw std::runtime_error(kvq_layer(il) + "RoPE mode " + std::to_string(mode) + " is not supported (NORM and NEOX are)");
    }
    const ggml_tensor * k_pre = k_rope->src[0];                // [DK, n_head_kv, n_tokens]
    const int64_t DK = k_pre->ne[0], n_head_kv = k_pre->ne[1];
    if (n_dims <= 0 || n_dims > DK || n_dims % 2 != 0) {
        throw std::runtime_error(kvq_layer(il) + "RoPE over " + std::to_string(n_dims) + " of " + std::to_string(DK) + " channels");
    }

    // the rotation's frequencies, from the node's own parameters and factors
    const ggml_tensor * ff = k_rope->src[2];
    std::vector<float> ffh;
    int ff_cols = 1;
    if (ff != nullptr) {
        if (ff->type != GGML_TYPE_F32 || ff->ne[0] < n_dims/2 || (ff->ne[1] != 1 && ff->ne[1] != n_head_kv)) {
            throw std::runtime_error(kvq_layer(il) + "rope factors " + ff->name + " are not F32 [n_rot/2] or [n_rot/2, n_head_kv]");
        }
        ff_cols = (int) ff->ne[1];
        std::vector<float> all(ggml_nelements(ff), 1.0f);
        // a model loaded without its weights (the tools' -fit probe) only sizes the graph: any frequencies do
        if (ff->data != nullptr && ff->buffer != nullptr) {
            ggml_backend_tensor_get(ff, all.data(), 0, ggml_nbytes(ff));
        }
        for (int c = 0; c < ff_cols; ++c) {   // rows may be longer than n_dims/2
            ffh.insert(ffh.end(), all.begin() + c*ff->ne[0], all.begin() + c*ff->ne[0] + n_dims/2);
        }
    }
    fa.freqs_host.assign((size_t) (n_dims/2)*n_head_kv, 0.0f);
    fa.mscale = ggml_kvq_rope_freqs(n_dims, n_ctx_orig, freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow,
                                    ff ? ffh.data() : nullptr, ff_cols, (int) n_head_kv, fa.freqs_host.data());
    fa.n_dims = n_dims;
    fa.mode   = mode;
    fa.freqs  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_dims/2, n_head_kv);
    ggml_format_name(fa.freqs, "kvq_rope_freqs-%d", il);
    ggml_set_input(fa.freqs);
}

ggml_tensor * llama_kvq_prerope_store(ggml_context * ctx, ggml_tensor * k_rope, ggml_tensor * mean, ggml_tensor * scale,
                                      llama_kvq_prerope_fa & fa, int il) {
    kvq_rope_of(ctx, k_rope, fa, il);
    ggml_tensor * k_pre = k_rope->src[0];
    const int64_t DK = k_pre->ne[0], n_head_kv = k_pre->ne[1];
    if (mean->ne[0] != DK || mean->ne[1] != n_head_kv || !ggml_are_same_shape(mean, scale) ||
        mean->type != GGML_TYPE_F32 || scale->type != GGML_TYPE_F32) {
        throw std::runtime_error(kvq_layer(il) + "blk." + std::to_string(il) + ".kvq_k_mean / kvq_k_scale must be F32 [" +
                                 std::to_string(DK) + ", " + std::to_string(n_head_kv) + "]");
    }
    fa.mean  = mean;
    fa.scale = scale;

    // what the cache stores: (k - mean) / scale, before RoPE
    ggml_tensor * c = ggml_div(ctx, ggml_sub(ctx, k_pre, mean), scale);
    ggml_format_name(c, "k_prerope-%d", il);
    return c;
}

ggml_tensor * llama_kvq_centred_store(ggml_context * ctx, ggml_tensor * k_rope, const std::vector<float> & centre,
                                      llama_kvq_prerope_fa & fa, int il) {
    kvq_rope_of(ctx, k_rope, fa, il);
    ggml_tensor * k_pre = k_rope->src[0];
    const int64_t DK = k_pre->ne[0], n_head_kv = k_pre->ne[1];
    if ((int64_t) centre.size() != DK*n_head_kv) {
        throw std::runtime_error(kvq_layer(il) + "the centred cache's mean has " + std::to_string(centre.size()) +
                                 " values for K [" + std::to_string(DK) + ", " + std::to_string(n_head_kv) + "]");
    }
    fa.centred = true;
    fa.mean = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, DK, n_head_kv);
    ggml_format_name(fa.mean, "kvq_k_centre-%d", il);
    ggml_set_input(fa.mean);

    // what the cache stores: the model's own RoPE of k - centre (RoPE is linear: R(p)k - R(p)centre)
    const int32_t * p = k_rope->op_params;
    float fp[6];
    memcpy(fp, p + 5, sizeof(fp));
    ggml_tensor * c = ggml_rope_ext(ctx, ggml_sub(ctx, k_pre, fa.mean), k_rope->src[1], k_rope->src[2], p[1], p[2], p[4],
                                    fp[0], fp[1], fp[2], fp[3], fp[4], fp[5]);
    ggml_format_name(c, "k_centred-%d", il);
    return c;
}

int llama_kvq_centre_pairs(std::vector<float> & mean, const std::vector<float> & var, int64_t DK, int64_t n_head_kv,
                           int n_dims, bool neox, double tau) {
    // the residual (k_centre_residual >= 0) trades the mean's scores (their cost grows with the kept pairs) for quality
    int kept = 0;
    for (int64_t h = 0; h < n_head_kv; ++h) {
        float * m = mean.data() + h*DK;
        const auto pair = [&](int i) { return neox ? std::pair<int, int>{i, i + n_dims/2} : std::pair<int, int>{2*i, 2*i + 1}; };
        std::vector<std::pair<double, int>> e(n_dims/2);
        double left = 0.0, v = 0.0;
        for (int i = 0; i < n_dims/2; ++i) {
            const auto [a, b] = pair(i);
            e[i] = { (double) m[a]*m[a] + (double) m[b]*m[b], i };
            left += e[i].first;
        }
        for (int64_t d = 0; d < DK && !var.empty(); ++d) {
            v += var[h*DK + d];
        }
        // without variances (a scale method other than std) every pair with a mean is kept
        const double allowed = var.empty() ? 0.0 : tau*v;
        std::sort(e.begin(), e.end(), [](const auto & x, const auto & y) { return x.first > y.first; });
        for (const auto & [en, i] : e) {
            if (left <= allowed || en == 0.0) {
                const auto [a, b] = pair(i);
                m[a] = m[b] = 0.0f;
                continue;
            }
            left -= en;
            ++kept;
        }
        for (int64_t d = n_dims; d < DK; ++d) {   // channels past the rotary ones: no rotation, no mean kept
            m[d] = 0.0f;
        }
    }
    return kept;
}

void llama_kvq_prerope_attach(ggml_tensor * fa_node, ggml_tensor * pos, const llama_kvq_prerope_fa & fa,
                              const ggml_tensor * k_rot) {
    if (fa_node == nullptr || fa_node->op != GGML_OP_FLASH_ATTN_EXT) {
        throw std::runtime_error("a pre-RoPE key cache needs flash attention (-fa on), or the post-RoPE cache (--kv-domain post)");
    }
    const int n_rot_h = k_rot ? (int) k_rot->ne[0] : 0;
    if (fa.centred) {
        ggml_kvq_fa_set_centred(fa_node, pos, fa.mean, fa.freqs, fa.n_dims, fa.mode, fa.mscale, n_rot_h);
    } else {
        ggml_kvq_fa_set_prerope(fa_node, pos, fa.mean, fa.scale, fa.freqs, fa.n_dims, fa.mode, fa.mscale, n_rot_h);
    }
    ggml_kvq_fa_set_hadamard_skip(fa_node, llama_kvq_k_rot_skip(k_rot));
}

void llama_kvq_fa_inputs_to_graph(ggml_cgraph * gf, ggml_tensor * fa_node) {
    // Sources attached after ggml_build_forward_expand reached the node are not in the graph: the scheduler gives
    // them the node's backend and the allocator compute-buffer memory that later nodes reuse. On CUDA the host's
    // write of the next ubatch's positions then raced the previous graph's last nodes (wrong pre-RoPE attention for
    // ubatches that reuse a graph: -ub 64 KLD 3.9 vs 0.04 on the CPU). As leafs they are host inputs, copied into
    // the split after the scheduler synchronizes its backend, as upstream's own inputs are.
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        ggml_tensor * t = fa_node->src[i];
        if (t != nullptr && t->op == GGML_OP_NONE && (t->flags & GGML_TENSOR_FLAG_INPUT)) {
            ggml_build_forward_expand(gf, t);
        }
    }
}

// the online K rotation of a cache with q53_64 / q42_64 keys (llama-kvq-prerope.h)
ggml_tensor * llama_kvq_new_k_rot_tensor(ggml_context * ctx, bool q53, int64_t nrot) {
    int32_t skip = 0;
    if (q53) {
        if (nrot <= 64) {
            nrot = std::min<int64_t>(nrot, LLAMA_KVQ_K_ROT_MIN);   // the same transform as leaving stride 32 out
        } else {
            skip = LLAMA_KVQ_K_ROT_MIN;
        }
    }
    ggml_tensor * res = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, nrot, nrot);
    memcpy(res->op_params, &skip, sizeof(skip));   // a leaf's op_params are free
    return res;
}

int llama_kvq_k_rot_skip(const ggml_tensor * k_rot) {
    int32_t skip = 0;
    if (k_rot != nullptr) {
        memcpy(&skip, k_rot->op_params, sizeof(skip));
    }
    return skip;
}

bool llama_kvq_k_rot_fill(ggml_tensor * k_rot) {
    const int skip = llama_kvq_k_rot_skip(k_rot);
    if (skip == 0) {
        return false;
    }
    GGML_ASSERT(ggml_backend_buffer_is_host(k_rot->buffer) && k_rot->type == GGML_TYPE_F32);
    const int64_t n = k_rot->ne[0];
    const uint32_t mask = (uint32_t) (n - 1) & ~(uint32_t) skip;
    const float h = 1.0f/sqrtf((float) (n/2));
    float * d = (float *) k_rot->data;
    for (int64_t i = 0; i < n; ++i) {      // Sylvester order, (-1)^popcount(i & j), over the kept index bits;
        for (int64_t j = 0; j < n; ++j) {  // the identity over the left-out one
            d[i*n + j] = (i ^ j) & skip ? 0.0f : __builtin_popcount((uint32_t) (i & j) & mask) & 1 ? -h : h;
        }
    }
    return true;
}
