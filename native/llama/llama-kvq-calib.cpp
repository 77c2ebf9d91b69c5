// Runtime calibration (pykvq.calibrate, the converter's default): per layer, KV head and channel statistics
// of the keys before RoPE, of the queries before RoPE and of the values, gathered from the graph's eval callback
// (llama_context_params.cb_eval) the way llama-imatrix gathers MUL_MAT inputs. It runs the GGUF's own quantized,
// memory-mapped weights at inference speed for every architecture whose graph rotates Q and K with a ROPE op,
// so converting a model needs the memory that running it needs, not an f32 checkpoint and a backward pass.
//
// What is pre-RoPE Q / K: src[0] of the ROPE nodes the model names "Qcur-<il>" / "Kcur-<il>", exactly the tensor
// the runtime's pre-RoPE key cache stores (llama-kvq-prerope.cpp reads the same node). ggml-alloc may compute a
// ROPE in place over its input, so nodes named Qcur* / Kcur* are copied when they are computed and the ROPE picks
// its input among them; an input that was not copied is read at the ROPE only when the ROPE did not overwrite it.
// V: the last node named Vcur*-<il> of a batch shaped [head_dim, n_head_kv, n_tokens] like that layer's K (what
// build_attn takes, before upstream's online V rotation).

#include "llama-kvq-api.h"
#include "llama-kvq-names.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

// (named, not in the anonymous namespace: llama_kvq_calib, a public type, holds them)
struct kvq_calib_slot {         // one of a layer's q / k / v
    int64_t hd = 0, nh = 0, n_tok = 0;
    std::vector<double> sum, sq;
    std::vector<float>  lo, hi;
    std::vector<float>  raw;    // keep_samples: [n_tok, nh, hd]
};

struct kvq_calib_captured {
    int64_t ne[3];
    std::vector<float> x;       // logical order, ne[0] fastest
};

struct llama_kvq_calib {
    bool keep_samples = false;
    std::vector<std::array<kvq_calib_slot, 3>> layers;                // q, k, v
    std::map<const ggml_tensor *, kvq_calib_captured> pending;        // Qcur* / Kcur* copies of this batch
    std::map<int, std::vector<kvq_calib_captured>> pending_v;         // Vcur* copies of this batch per layer
    std::string error;
    std::vector<uint8_t> staging;
    int32_t rope_mode = -1, rope_n_dims = -1;                          // of the K ROPE nodes (all the same)
};

namespace {

bool readable(const ggml_tensor * t) {
    return (t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_BF16) && t->ne[3] == 1;
}

// t's values as f32 in logical order (any strides, host or device buffer); false for a type it cannot read
bool read_f32(llama_kvq_calib * c, const ggml_tensor * t, kvq_calib_captured & out) {
    if (!readable(t)) {
        c->error = std::string("tensor ") + t->name + " has type " + ggml_type_name(t->type) +
                   (t->ne[3] != 1 ? " and a 4th dimension" : "") + " (3-D f32/f16/bf16 expected)";
        return false;
    }
    const size_t nbytes = ggml_nbytes(t);
    const char * base;
    if (t->buffer == nullptr || ggml_backend_buffer_is_host(t->buffer)) {
        base = (const char *) t->data;
    } else {
        c->staging.resize(nbytes);
        ggml_backend_tensor_get(t, c->staging.data(), 0, nbytes);
        base = (const char *) c->staging.data();
    }
    for (int i = 0; i < 3; ++i) {
        out.ne[i] = t->ne[i];
    }
    out.x.resize((size_t) (t->ne[0] * t->ne[1] * t->ne[2]));
    float * dst = out.x.data();
    for (int64_t i2 = 0; i2 < t->ne[2]; ++i2) {
        for (int64_t i1 = 0; i1 < t->ne[1]; ++i1) {
            const char * row = base + i2*t->nb[2] + i1*t->nb[1];
            for (int64_t i0 = 0; i0 < t->ne[0]; ++i0) {
                const char * p = row + i0*t->nb[0];
                float v;
                if (t->type == GGML_TYPE_F32) {
                    memcpy(&v, p, sizeof(v));
                } else if (t->type == GGML_TYPE_F16) {
                    ggml_fp16_t h;
                    memcpy(&h, p, sizeof(h));
                    v = ggml_fp16_to_fp32(h);
                } else {
                    ggml_bf16_t h;
                    memcpy(&h, p, sizeof(h));
                    v = ggml_bf16_to_fp32(h);
                }
                *dst++ = v;
            }
        }
    }
    return true;
}

bool accumulate(llama_kvq_calib * c, int il, int which, const kvq_calib_captured & x) {
    if ((int) c->layers.size() <= il) {
        c->layers.resize(il + 1);
    }
    kvq_calib_slot & s = c->layers[il][which];
    const int64_t hd = x.ne[0], nh = x.ne[1], nt = x.ne[2], n = hd*nh;
    if (s.hd == 0) {
        s.hd = hd;
        s.nh = nh;
        s.sum.assign(n, 0.0);
        s.sq.assign(n, 0.0);
        s.lo.assign(n, std::numeric_limits<float>::infinity());
        s.hi.assign(n, -std::numeric_limits<float>::infinity());
    } else if (s.hd != hd || s.nh != nh) {
        char buf[160];
        snprintf(buf, sizeof(buf), "layer %d: %c changed shape from [%lld, %lld] to [%lld, %lld] between batches",
                 il, "qkv"[which], (long long) s.hd, (long long) s.nh, (long long) hd, (long long) nh);
        c->error = buf;
        return false;
    }
    for (int64_t t = 0; t < nt; ++t) {
        const float * r = x.x.data() + t*n;
        for (int64_t i = 0; i < n; ++i) {
            const double v = r[i];
            s.sum[i] += v;
            s.sq[i]  += v*v;
            s.lo[i] = std::min(s.lo[i], r[i]);
            s.hi[i] = std::max(s.hi[i], r[i]);
        }
    }
    s.n_tok += nt;
    if (c->keep_samples) {
        s.raw.insert(s.raw.end(), x.x.begin(), x.x.end());
    }
    return true;
}

bool wants(const ggml_tensor * t) {
    const bool qk = llama_kvq_layer_of(t->name, "Qcur") >= 0 || llama_kvq_layer_of(t->name, "Kcur") >= 0;
    if (t->op == GGML_OP_ROPE) {
        return qk;
    }
    // a candidate of a type read_f32 cannot read is not what a ROPE takes (and if it is, on_rope says so)
    return (qk || llama_kvq_layer_of(t->name, "Vcur") >= 0) && readable(t);
}

bool on_rope(llama_kvq_calib * c, const ggml_tensor * t) {
    const bool is_q = llama_kvq_layer_of(t->name, "Qcur") >= 0;
    const int il = is_q ? llama_kvq_layer_of(t->name, "Qcur") : llama_kvq_layer_of(t->name, "Kcur");
    const ggml_tensor * src = t->src[0];
    if (!is_q) {
        const int32_t mode = ((const int32_t *) t->op_params)[2], n_dims = ((const int32_t *) t->op_params)[1];
        if (c->rope_mode >= 0 && (mode != c->rope_mode || n_dims != c->rope_n_dims)) {
            c->error = "layer " + std::to_string(il) + ": its K rotates with RoPE mode " + std::to_string(mode) +
                       " over " + std::to_string(n_dims) + " dims, earlier layers with mode " +
                       std::to_string(c->rope_mode) + " over " + std::to_string(c->rope_n_dims);
            return false;
        }
        c->rope_mode = mode;
        c->rope_n_dims = n_dims;
    }
    kvq_calib_captured x;
    auto it = c->pending.find(src);
    if (it != c->pending.end()) {
        x = std::move(it->second);
        c->pending.erase(it);
    } else {
        const char * a = (const char *) src->data, * b = (const char *) t->data;
        if (a == nullptr || (a < b + ggml_nbytes(t) && b < a + ggml_nbytes(src))) {   // computed in place
            c->error = std::string("the input of ROPE node ") + t->name + " (" + src->name +
                       ") was overwritten before it could be read; this architecture names it differently";
            return false;
        }
        if (!read_f32(c, src, x)) {
            return false;
        }
    }
    return accumulate(c, il, is_q ? 0 : 1, x);
}

} // namespace

extern "C" {

struct llama_kvq_calib * llama_kvq_calib_init(bool keep_samples) {
    auto * c = new llama_kvq_calib();
    c->keep_samples = keep_samples;
    return c;
}

void llama_kvq_calib_free(struct llama_kvq_calib * c) {
    delete c;
}

bool llama_kvq_calib_eval_cb(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * c = (llama_kvq_calib *) user_data;
    if (ask) {
        return c->error.empty() && wants(t);
    }
    if (!c->error.empty()) {
        return true;
    }
    if (t->op == GGML_OP_ROPE) {
        on_rope(c, t);
        return true;
    }
    kvq_calib_captured x;
    if (!read_f32(c, t, x)) {
        return true;
    }
    const int iv = llama_kvq_layer_of(t->name, "Vcur");
    if (iv >= 0) {
        c->pending_v[iv].push_back(std::move(x));
    } else {
        c->pending[t] = std::move(x);
    }
    return true;
}

void llama_kvq_calib_attach(struct llama_kvq_calib * c, struct llama_context_params * params) {
    params->cb_eval = llama_kvq_calib_eval_cb;
    params->cb_eval_user_data = c;
}

bool llama_kvq_calib_end_batch(struct llama_kvq_calib * c) {
    c->pending.clear();
    if (c->error.empty()) {
        for (auto & [il, cands] : c->pending_v) {
            if (il >= (int) c->layers.size() || c->layers[il][1].hd == 0) {
                continue;                       // a layer without a rotated K (no KV of its own)
            }
            const kvq_calib_slot & k = c->layers[il][1];
            const int64_t nt = k.n_tok - c->layers[il][2].n_tok;   // the tokens K gained in this batch
            const kvq_calib_captured * pick = nullptr;
            for (const auto & v : cands) {
                if (v.ne[0] == k.hd && v.ne[1] == k.nh && v.ne[2] == nt) {
                    pick = &v;                  // the last of that shape: what build_attn took
                }
            }
            if (pick == nullptr) {
                c->error = "layer " + std::to_string(il) + ": no node named Vcur-" + std::to_string(il) +
                           " shaped like its keys; this architecture's V is not supported";
                break;
            }
            if (!accumulate(c, il, 2, *pick)) {
                break;
            }
        }
    }
    c->pending_v.clear();
    return c->error.empty();
}

const char * llama_kvq_calib_error(const struct llama_kvq_calib * c) {
    return c->error.c_str();
}

bool llama_kvq_calib_rope(const struct llama_kvq_calib * c, int32_t * mode, int32_t * n_dims) {
    *mode = c->rope_mode;
    *n_dims = c->rope_n_dims;
    return c->rope_mode >= 0;
}

int32_t llama_kvq_calib_n_layer(const struct llama_kvq_calib * c) {
    return (int32_t) c->layers.size();
}

bool llama_kvq_calib_shape(const struct llama_kvq_calib * c, int32_t il, int32_t which,
                           int64_t * head_dim, int64_t * n_head, int64_t * n_tokens) {
    if (il < 0 || il >= (int32_t) c->layers.size() || which < 0 || which > 2 || c->layers[il][which].hd == 0) {
        return false;
    }
    const kvq_calib_slot & s = c->layers[il][which];
    *head_dim = s.hd;
    *n_head = s.nh;
    *n_tokens = s.n_tok;
    return true;
}

int64_t llama_kvq_calib_get(const struct llama_kvq_calib * c, int32_t il, int32_t which, const char * what,
                            void * dst, int64_t capacity) {
    if (il < 0 || il >= (int32_t) c->layers.size() || which < 0 || which > 2) {
        return -1;
    }
    const kvq_calib_slot & s = c->layers[il][which];
    const std::string w = what;
    const void * src;
    int64_t n;
    size_t size;
    if (w == "sum" || w == "sq") {
        const auto & v = w == "sum" ? s.sum : s.sq;
        src = v.data(); n = (int64_t) v.size(); size = sizeof(double);
    } else if (w == "min" || w == "max") {
        const auto & v = w == "min" ? s.lo : s.hi;
        src = v.data(); n = (int64_t) v.size(); size = sizeof(float);
    } else if (w == "samples") {
        src = s.raw.data(); n = (int64_t) s.raw.size(); size = sizeof(float);
    } else {
        return -1;
    }
    if (dst == nullptr) {
        return n;
    }
    n = std::min(n, capacity);
    memcpy(dst, src, (size_t) n*size);
    return n;
}

} // extern "C"
