// pykvq: what a converted GGUF asks of the runtime: its pykvq.cache.* keys (per-layer types, codebook
// calibration, key domain), host copies of the nuq codebooks, and the defaults a context takes from them.
// The llama_model methods are declared in src/llama-model.h (the model loading seam); their bodies live here.
#include "llama-kvq-codebooks.h"
#include "llama-kvq-model.h"
#include "llama-kvq-prerope.h"
#include "llama-kvq-settings.h"
#include "llama-kvq-keys.h"

#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

// the types a KV cache can hold (upstream's -ctk/-ctv list and pykvq's); anything else in a file is an error,
// not a cache of i32 or q4_K that no kernel writes
static bool kvq_cache_type_ok(ggml_type t) {
    switch (t) {
        case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16: case GGML_TYPE_Q8_0: case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1: case GGML_TYPE_IQ4_NL: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1:
            return true;
        default:
            return ggml_kvq_type_is_kvq(t);
    }
}

static const char * kvq_gguf_type_name(const gguf_context * ctx, int64_t kid) {
    return gguf_get_kv_type(ctx, kid) == GGUF_TYPE_ARRAY ? "array" : gguf_type_name(gguf_get_kv_type(ctx, kid));
}

// a cache type name from a file: a type this build knows and a KV cache can hold, else an error naming the key
static ggml_type kvq_cache_type_from_key(const char * key, const char * name) {
    const ggml_type t = llama_kvq_type_from_name(name);
    if (t == GGML_TYPE_COUNT || !kvq_cache_type_ok(t)) {
        throw std::runtime_error(format("%s = '%.64s': not a KV cache type this build knows (f16, q8_0, q4_0, bfp4_32, nuq4, ...)", key, name));
    }
    return t;
}

// pykvq.* keys: each known one must have its type and one of its values; an unknown one (a newer converter's)
// is named in a warning and otherwise ignored
static void kvq_check_keys(const gguf_context * ctx) {
    struct spec { const char * key; gguf_type type; std::vector<const char *> values; };
    static const std::vector<spec> specs = {
        { LLAMA_KVQ_KEY_GENERAL_VERSION,         GGUF_TYPE_STRING, {} },
        { LLAMA_KVQ_KEY_CACHE_TYPE_K,            GGUF_TYPE_STRING, {} },
        { LLAMA_KVQ_KEY_CACHE_TYPE_V,            GGUF_TYPE_STRING, {} },
        { LLAMA_KVQ_KEY_CACHE_LAYER_TYPES_K,     GGUF_TYPE_ARRAY,  {} },
        { LLAMA_KVQ_KEY_CACHE_LAYER_TYPES_V,     GGUF_TYPE_ARRAY,  {} },
        { LLAMA_KVQ_KEY_CACHE_CODEBOOK_METHOD,   GGUF_TYPE_STRING, {} },
        { LLAMA_KVQ_KEY_CACHE_CODEBOOK_QNORM,    GGUF_TYPE_BOOL,   {} },
        { LLAMA_KVQ_KEY_CACHE_CODEBOOK_ROT_K,    GGUF_TYPE_BOOL,   {} },
        { LLAMA_KVQ_KEY_CACHE_CODEBOOK_ROT_V,    GGUF_TYPE_BOOL,   {} },
        { LLAMA_KVQ_KEY_CACHE_K_DOMAIN,          GGUF_TYPE_STRING, { LLAMA_KVQ_VALUE_K_DOMAIN_PREROPE, LLAMA_KVQ_VALUE_K_DOMAIN_POSTROPE } },
        { LLAMA_KVQ_KEY_CACHE_K_SCALE_METHOD,    GGUF_TYPE_STRING, {} },
        { LLAMA_KVQ_KEY_CACHE_KV_SINKS,          GGUF_TYPE_UINT32, {} },
        { LLAMA_KVQ_KEY_CACHE_KV_WINDOW,         GGUF_TYPE_UINT32, {} },
        { LLAMA_KVQ_KEY_CACHE_KV_WINDOW_TYPE,    GGUF_TYPE_STRING, { "f16", "q8_0" } },
        { LLAMA_KVQ_KEY_CACHE_KV_HEAVY,          GGUF_TYPE_FLOAT32, {} },
        { LLAMA_KVQ_KEY_BAKED_KSORT,             GGUF_TYPE_BOOL,   {} },
        { LLAMA_KVQ_KEY_BAKED_KSORT_KEY,         GGUF_TYPE_STRING, {} },
        { LLAMA_KVQ_KEY_BAKED_SMOOTH_QK,         GGUF_TYPE_BOOL,   {} },
        { LLAMA_KVQ_KEY_BAKED_SMOOTH_ALPHA,      GGUF_TYPE_ARRAY,  {} },
        { LLAMA_KVQ_KEY_BAKED_ROTATE_V,          GGUF_TYPE_STRING, { LLAMA_KVQ_VALUE_ROTATE_V_NONE, LLAMA_KVQ_VALUE_ROTATE_V_HADAMARD, LLAMA_KVQ_VALUE_ROTATE_V_LEARNED } },
        { LLAMA_KVQ_KEY_BAKED_ROTATE_V_LAYERS,   GGUF_TYPE_ARRAY,  {} },
        { LLAMA_KVQ_KEY_BAKED_ROTATE_V_COND,     GGUF_TYPE_ARRAY,  {} },
        { LLAMA_KVQ_KEY_BAKED_LEARN_K,           GGUF_TYPE_BOOL,   {} },
        { LLAMA_KVQ_KEY_BAKED_LEARN_K_LAYERS,    GGUF_TYPE_ARRAY,  {} },
        { LLAMA_KVQ_KEY_ROPE_LAYOUT,             GGUF_TYPE_STRING, { LLAMA_KVQ_VALUE_ROPE_LAYOUT_NORM } },
        { LLAMA_KVQ_KEY_CALIB_SOURCE,            GGUF_TYPE_STRING, {} },
    };
    for (int64_t kid = 0; kid < gguf_get_n_kv(ctx); ++kid) {
        const char * key = gguf_get_key(ctx, kid);
        if (strncmp(key, "pykvq.", 6) != 0) {
            continue;
        }
        const auto it = std::find_if(specs.begin(), specs.end(), [&](const spec & s) { return strcmp(s.key, key) == 0; });
        if (it == specs.end()) {
            LLAMA_LOG_WARN("%s: unknown key %s (from a newer converter?) ignored\n", __func__, key);
            continue;
        }
        if (gguf_get_kv_type(ctx, kid) != it->type) {
            throw std::runtime_error(format("%s must be of GGUF type %s, not %s", key,
                    it->type == GGUF_TYPE_ARRAY ? "array" : gguf_type_name(it->type), kvq_gguf_type_name(ctx, kid)));
        }
        if (!it->values.empty()) {
            const char * val = gguf_get_val_str(ctx, kid);
            if (std::none_of(it->values.begin(), it->values.end(), [&](const char * v) { return strcmp(v, val) == 0; })) {
                std::string want;
                for (const char * v : it->values) {
                    want += (want.empty() ? "'" : ", '") + std::string(v) + "'";
                }
                throw std::runtime_error(format("%s = '%.64s': expected %s", key, val, want.c_str()));
            }
        }
        if (strcmp(key, LLAMA_KVQ_KEY_CACHE_KV_HEAVY) == 0) {
            const float f = gguf_get_val_f32(ctx, kid);
            if (!(f >= 0.0f && f <= 1.0f)) {
                throw std::runtime_error(format("%s = %g: expected a fraction of the context in [0, 1]", key, (double) f));
            }
        }
    }
}

// blk.N.kvq_* tensors: pykvq's namespace, so one this build does not know, or past the last layer, is named here
// (the loader would only say "wrong number of tensors")
static void kvq_check_tensor_names(const gguf_context * ctx) {
    static const char * known[] = { LLAMA_KVQ_TENSOR_ROPE_FREQS, LLAMA_KVQ_TENSOR_CODEBOOK_K, LLAMA_KVQ_TENSOR_CODEBOOK_V,
                                    LLAMA_KVQ_TENSOR_K_MEAN, LLAMA_KVQ_TENSOR_K_SCALE, LLAMA_KVQ_TENSOR_K_STD,
                                    LLAMA_KVQ_TENSOR_Q_MEAN };
    int64_t n_layer = -1;
    const int64_t aid = gguf_find_key(ctx, "general.architecture");
    if (aid >= 0 && gguf_get_kv_type(ctx, aid) == GGUF_TYPE_STRING) {
        const int64_t bid = gguf_find_key(ctx, (std::string(gguf_get_val_str(ctx, aid)) + ".block_count").c_str());
        if (bid >= 0 && gguf_get_kv_type(ctx, bid) == GGUF_TYPE_UINT32) {
            n_layer = gguf_get_val_u32(ctx, bid);
        }
    }
    for (int64_t i = 0; i < gguf_get_n_tensors(ctx); ++i) {
        const char * name = gguf_get_tensor_name(ctx, i);
        if (strstr(name, ".kvq_") == nullptr && strncmp(name, "kvq_", 4) != 0) {
            continue;
        }
        int il = -1;
        int n = 0;
        if (sscanf(name, "blk.%d.%n", &il, &n) != 1 || n == 0 || il < 0) {
            throw std::runtime_error(format("tensor %s: pykvq's tensors are blk.N.kvq_* (N a layer)", name));
        }
        int kind = -1;
        for (int k = 0; k < (int) (sizeof(known)/sizeof(known[0])); ++k) {
            kind = format(known[k], il) == name ? k : kind;
        }
        if (kind < 0) {
            throw std::runtime_error(format("tensor %s: not a pykvq tensor this build knows (kvq_rope_freqs, kvq_codebook_k/v, kvq_k_mean/scale/std, kvq_q_mean)", name));
        }
        // the type before the loader sees it: it test-builds the tensor's op (ggml_rope_ext asserts on a non-F32 factor)
        const ggml_type want = kind == 1 || kind == 2 ? GGML_TYPE_I8 : GGML_TYPE_F32;
        const ggml_type type = gguf_get_tensor_type(ctx, i);
        if (type != want) {
            throw std::runtime_error(format("tensor %s must be %s, not %s", name, ggml_type_name(want),
                    type >= 0 && type < GGML_TYPE_COUNT ? ggml_type_name(type) : "an unknown type"));
        }
        if (n_layer >= 0 && il >= n_layer) {
            throw std::runtime_error(format("tensor %s: layer %d of a model with %lld layers", name, il, (long long) n_layer));
        }
    }
}

void llama_kvq_load_cache_keys(llama_model & model, const gguf_context * ctx) {
    auto & kvq = model.kvq;
    const auto & gguf_kv = model.gguf_kv;
    kvq_check_keys(ctx);
    kvq_check_tensor_names(ctx);
    // per-layer cache types (string arrays, which gguf_kv leaves out) and the keys the codebooks were calibrated under
    for (int v = 0; v < 2; ++v) {
        const char * key_layers = v ? LLAMA_KVQ_KEY_CACHE_LAYER_TYPES_V : LLAMA_KVQ_KEY_CACHE_LAYER_TYPES_K;
        const char * key_type   = v ? LLAMA_KVQ_KEY_CACHE_TYPE_V        : LLAMA_KVQ_KEY_CACHE_TYPE_K;
        const char * key_rot    = v ? LLAMA_KVQ_KEY_CACHE_CODEBOOK_ROT_V : LLAMA_KVQ_KEY_CACHE_CODEBOOK_ROT_K;
        kvq.layer_types[v].clear();
        const int64_t kid = gguf_find_key(ctx, key_layers);
        if (kid >= 0) {
            if (gguf_get_kv_type(ctx, kid) != GGUF_TYPE_ARRAY || gguf_get_arr_type(ctx, kid) != GGUF_TYPE_STRING) {
                throw std::runtime_error(format("%s must be an array of ggml type names", key_layers));
            }
            for (size_t i = 0; i < gguf_get_arr_n(ctx, kid); ++i) {
                const std::string key_i = format("%s[%zu]", key_layers, i);
                kvq.layer_types[v].push_back(kvq_cache_type_from_key(key_i.c_str(), gguf_get_arr_str(ctx, kid, i)));
            }
        }
        const auto it = gguf_kv.find(key_type);
        kvq.file_type[v] = it == gguf_kv.end() ? GGML_TYPE_COUNT : kvq_cache_type_from_key(key_type, it->second.c_str());
        const auto ir = gguf_kv.find(key_rot);
        kvq.codebook_rot[v] = ir == gguf_kv.end() ? -1 : ir->second == "true" ? 1 : 0;
    }
    const auto it = gguf_kv.find(LLAMA_KVQ_KEY_CACHE_K_DOMAIN);
    kvq.k_prerope = it != gguf_kv.end() && it->second == LLAMA_KVQ_VALUE_K_DOMAIN_PREROPE;
}

// the host copy of a weight tensor as f32 (only F32 tensors; the caller checked the type)
static std::vector<float> kvq_f32(const ggml_tensor * t) {
    std::vector<float> v(ggml_nelements(t));
    ggml_backend_tensor_get(t, v.data(), 0, ggml_nbytes(t));
    return v;
}

// K-sorted files: blk.N.kvq_rope_freqs [n_rot/2, n_head_kv] moves each rotary pair's frequency with the pair, so per
// KV head the frequencies base^(-2p/n_rot) / ff[p] must be the model's own (base^(-2q/n_rot) / rope_freqs[q]) in
// another order: a factor that is not finite and > 0, or a broken permutation, would rotate keys at wrong speeds.
static void llama_kvq_check_rope_freqs(const llama_model & model) {
    const auto & hp = model.hparams;
    const bool ksort = [&] {
        const auto it = model.gguf_kv.find(LLAMA_KVQ_KEY_BAKED_KSORT);
        return it != model.gguf_kv.end() && it->second == "true";
    }();
    for (uint32_t il = 0; il < hp.n_layer_all; ++il) {
        const ggml_tensor * ff = model.layers[il].kvq_rope_freqs;
        const int n_pair = (int) hp.n_rot(il) / 2;
        if (ff == nullptr) {
            if (ksort && n_pair > 0) {
                throw std::runtime_error(format(LLAMA_KVQ_KEY_BAKED_KSORT " is true but " LLAMA_KVQ_TENSOR_ROPE_FREQS
                        " is missing: the layer's keys would rotate at the wrong frequencies", il));
            }
            continue;
        }
        const std::string name = ggml_get_name(ff);
        if (ff->type != GGML_TYPE_F32) {
            throw std::runtime_error(format("%s must be F32, not %s", name.c_str(), ggml_type_name(ff->type)));
        }
        if (ff->ne[0] != n_pair || ff->ne[1] != (int64_t) hp.n_head_kv(il)) {
            throw std::runtime_error(format("%s must be [%d, %u], not [%lld, %lld]", name.c_str(), n_pair, hp.n_head_kv(il),
                    (long long) ff->ne[0], (long long) ff->ne[1]));
        }
        if (ff->data == nullptr || ff->buffer == nullptr) {
            continue; // loaded without weights
        }
        const double base = hp.is_swa(il) ? hp.rope_freq_base_train_swa : hp.rope_freq_base_train;
        const ggml_tensor * rf = model.layers[il].rope_freqs;
        std::vector<float> rfh;
        if (rf != nullptr && rf->type == GGML_TYPE_F32 && ggml_nelements(rf) >= n_pair && rf->data != nullptr && rf->buffer != nullptr) {
            rfh = kvq_f32(rf);
        }
        std::vector<double> want(n_pair), got(n_pair);
        for (int q = 0; q < n_pair; ++q) {
            want[q] = -2.0*q/(2*n_pair)*std::log(base) - (rfh.empty() ? 0.0 : std::log((double) rfh[q]));
        }
        std::sort(want.begin(), want.end());
        const std::vector<float> v = kvq_f32(ff);
        for (int64_t h = 0; h < ff->ne[1]; ++h) {
            for (int p = 0; p < n_pair; ++p) {
                const float f = v[h*n_pair + p];
                if (!std::isfinite(f) || !(f > 0.0f)) {
                    throw std::runtime_error(format("%s[%d, %lld] = %g: a rope factor must be finite and > 0", name.c_str(), p, (long long) h, f));
                }
                got[p] = -2.0*p/(2*n_pair)*std::log(base) - std::log((double) f);
            }
            std::sort(got.begin(), got.end());
            for (int p = 0; p < n_pair; ++p) {
                if (!std::isfinite(want[p]) || std::fabs(got[p] - want[p]) > 1e-3) {   // f32 factors: ~1e-7
                    throw std::runtime_error(format("%s, KV head %lld: the frequencies are not a permutation of the model's "
                            "(rope base %g%s): a broken K-sort", name.c_str(), (long long) h, base, rfh.empty() ? "" : " and rope_freqs"));
                }
            }
        }
    }
}

// pre-RoPE statistics: F32 (the shape is the loader's), finite, a scale > 0, and a layer has both or neither
static void llama_kvq_check_k_stats(const llama_model & model) {
    for (uint32_t il = 0; il < model.hparams.n_layer_all; ++il) {
        const ggml_tensor * mean  = model.layers[il].kvq_k_mean;
        const ggml_tensor * scale = model.layers[il].kvq_k_scale;
        if ((mean == nullptr) != (scale == nullptr)) {
            throw std::runtime_error(format("%s is present but %s is missing", mean ? ggml_get_name(mean) : ggml_get_name(scale),
                    format(mean ? LLAMA_KVQ_TENSOR_K_SCALE : LLAMA_KVQ_TENSOR_K_MEAN, (int) il).c_str()));
        }
        if (mean != nullptr) {
            llama_kvq_prerope_check_stats(mean, scale, (int) il);
        }
        const ggml_tensor * std = model.layers[il].kvq_k_std;   // optional; the same rules as a scale
        if (std != nullptr && mean == nullptr) {
            throw std::runtime_error(format("%s is present but %s is missing", ggml_get_name(std),
                    format(LLAMA_KVQ_TENSOR_K_MEAN, (int) il).c_str()));
        }
        if (std != nullptr) {
            llama_kvq_prerope_check_stats(mean, std, (int) il);
        }
        const ggml_tensor * q_mean = model.layers[il].kvq_q_mean;   // optional; the rules of a mean
        if (q_mean != nullptr && mean == nullptr) {
            throw std::runtime_error(format("%s is present but %s is missing", ggml_get_name(q_mean),
                    format(LLAMA_KVQ_TENSOR_K_MEAN, (int) il).c_str()));
        }
        if (q_mean != nullptr) {
            llama_kvq_prerope_check_stats(q_mean, scale, (int) il);
        }
    }
}

void llama_kvq_load_codebooks(llama_model & model) {
    // host copies: graph nodes carry the codebooks in their op_params
    const int n_layer = (int) model.hparams.n_layer_all;
    for (int v = 0; v < 2; ++v) {
        model.kvq.codebook[v].assign(n_layer, {});
        model.kvq.has_codebook[v].assign(n_layer, 0);
        for (int il = 0; il < n_layer; ++il) {
            const ggml_tensor * t = v ? model.layers[il].kvq_codebook_v : model.layers[il].kvq_codebook_k;
            if (t == nullptr) {
                continue;
            }
            if (t->type != GGML_TYPE_I8 || ggml_nelements(t) != 16) {
                throw std::runtime_error(format("%s: expected an I8 tensor of 16 values, got %s with %lld",
                        ggml_get_name(t), ggml_type_name(t->type), (long long) ggml_nelements(t)));
            }
            ggml_backend_tensor_get(t, model.kvq.codebook[v][il].data(), 0, 16);
            model.kvq.has_codebook[v][il] = 1;   // its entries are checked when a context uses it (llama_kvq_layer_codebook)
        }
        const auto & lt = model.kvq.layer_types[v];
        if (!lt.empty() && lt.size() != (size_t) n_layer) {
            throw std::runtime_error(format("%s has %zu entries for %d layers", v ? LLAMA_KVQ_KEY_CACHE_LAYER_TYPES_V : LLAMA_KVQ_KEY_CACHE_LAYER_TYPES_K,
                    lt.size(), n_layer));
        }
    }
    llama_kvq_check_rope_freqs(model);
    llama_kvq_check_k_stats(model);
}

const int8_t * llama_kvq_layer_codebook(const llama_model & model, int il, bool v, ggml_type type) {
    const int8_t * cb = model.kvq.codebook_for(il, v, type);
    if (cb != nullptr && !llama_kvq_codebook_ok(cb, type)) {
        throw std::runtime_error(format("blk.%d.kvq_codebook_%c is not a valid %s codebook (%d entries strictly ascending in [-127, 127])",
                il, v ? 'v' : 'k', ggml_type_name(type), llama_kvq_n_codes(type)));
    }
    return cb;
}

ggml_type llama_kvq_model_info::cache_type(ggml_type requested, uint32_t il, bool v) const {
    if (requested != LLAMA_KV_CACHE_TYPE_MODEL) {
        return requested;
    }
    const auto & lt = layer_types[v];
    if (il < lt.size()) {
        return lt[il];
    }
    return file_type[v] != GGML_TYPE_COUNT ? file_type[v] : GGML_TYPE_F16;
}

ggml_type llama_kvq_model_info::calibrated_type(uint32_t il, bool v) const {
    const auto & lt = layer_types[v];
    return il < lt.size() ? lt[il] : file_type[v];
}

const int8_t * llama_kvq_model_info::codebook_for(uint32_t il, bool v, ggml_type type) const {
    if (!llama_kvq_is_nuq(type) || il >= has_codebook[v].size() || !has_codebook[v][il]) {
        return nullptr;
    }
    return calibrated_type(il, v) == type ? codebook[v][il].data() : nullptr;
}

// pykvq: resolve what the caller left open from the keys a pykvq-converted GGUF carries, and say where
// each choice came from. An explicit type or rotation from the caller always wins.
void llama_kvq_apply_model_defaults(const llama_model & model, llama_context_params & params, llama_kvq_ctx_opts & kvq) {
    const auto key = [&](const char * name) -> std::string {
        const auto it = model.gguf_kv.find(name);
        return it == model.gguf_kv.end() ? std::string() : it->second;
    };
    const auto pick = [&](ggml_type & type, const char * name, const char * which) {
        if (type != LLAMA_KV_CACHE_TYPE_MODEL) {
            LLAMA_LOG_INFO("%s: cache type %s = %s (set by the caller)\n", "llama_kvq_apply_model_defaults", which, ggml_type_name(type));
            return;
        }
        // per-layer types: type stays LLAMA_KV_CACHE_TYPE_MODEL and llama_kv_cache gives each layer its own
        const bool is_v = which[0] == 'V';
        const auto & layer_types = model.kvq.layer_types[is_v];
        if (!layer_types.empty()) {
            const uint32_t n_layer = model.hparams.n_layer_all;
            LLAMA_LOG_INFO("%s: cache type %s per layer (from the GGUF's pykvq.cache.layer_types_%c)\n",
                    "llama_kvq_apply_model_defaults", which, is_v ? 'v' : 'k');
            if (layer_types.size() != n_layer) {
                LLAMA_LOG_WARN("%s: pykvq.cache.layer_types_%c has %zu entries for %u layers; layers past the list get %s\n",
                        "llama_kvq_apply_model_defaults", is_v ? 'v' : 'k', layer_types.size(), n_layer,
                        ggml_type_name(model.kvq.cache_type(LLAMA_KV_CACHE_TYPE_MODEL, n_layer, is_v)));
            }
            return;
        }
        const std::string want = key(name);
        type = GGML_TYPE_F16;
        for (int t = 0; t < GGML_TYPE_COUNT && !want.empty(); ++t) {
            const char * tn = ggml_type_name((ggml_type) t);
            if (tn && want == tn) {
                type = (ggml_type) t;
                LLAMA_LOG_INFO("%s: cache type %s = %s (from the GGUF's %s)\n", "llama_kvq_apply_model_defaults", which, tn, name);
                return;
            }
        }
        if (!want.empty()) {
            LLAMA_LOG_WARN("%s: the GGUF's %s = '%s' is not a type this build knows; cache type %s = f16\n", "llama_kvq_apply_model_defaults", name, want.c_str(), which);
        } else {
            LLAMA_LOG_INFO("%s: cache type %s = f16 (default)\n", "llama_kvq_apply_model_defaults", which);
        }
    };
    pick(params.type_k, LLAMA_KVQ_KEY_CACHE_TYPE_K, "K");
    pick(params.type_v, LLAMA_KVQ_KEY_CACHE_TYPE_V, "V");

    // the exact window the converter chose (a pre-RoPE file), unless the caller set one (0 turns it off)
    for (auto [n, name, what] : { std::tuple<int *, const char *, const char *>{ &kvq.kv_sinks, LLAMA_KVQ_KEY_CACHE_KV_SINKS, "sinks" },
                                  std::tuple<int *, const char *, const char *>{ &kvq.kv_window, LLAMA_KVQ_KEY_CACHE_KV_WINDOW, "window" } }) {
        const std::string v = key(name);
        if (*n >= 0 || v.empty()) {
            continue;
        }
        // a uint32 (kvq_check_keys); the cache clamps a window past its size
        *n = (int) std::min<unsigned long long>(std::stoull(v), INT32_MAX);
        LLAMA_LOG_INFO("%s: exact %s = %d (from the GGUF's %s; --kv-%s 0 turns it off)\n", "llama_kvq_apply_model_defaults",
                       what, *n, name, what);
    }
    if (kvq.kv_window_type < 0 && !key(LLAMA_KVQ_KEY_CACHE_KV_WINDOW_TYPE).empty()) {
        kvq.kv_window_type = key(LLAMA_KVQ_KEY_CACHE_KV_WINDOW_TYPE) == "q8_0" ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
        LLAMA_LOG_INFO("%s: exact window rows in %s (from the GGUF's %s)\n", "llama_kvq_apply_model_defaults",
                       ggml_type_name((ggml_type) kvq.kv_window_type), LLAMA_KVQ_KEY_CACHE_KV_WINDOW_TYPE);
    }
    if (kvq.kv_heavy < 0.0 && !key(LLAMA_KVQ_KEY_CACHE_KV_HEAVY).empty()) {
        // a float32 in [0, 1] (kvq_check_keys), held as text by the loader
        kvq.kv_heavy = std::stod(key(LLAMA_KVQ_KEY_CACHE_KV_HEAVY));
        LLAMA_LOG_INFO("%s: heavy hitters = %g of each sequence's cells (from the GGUF's %s; --kv-heavy 0 turns them off)\n",
                       "llama_kvq_apply_model_defaults", kvq.kv_heavy, LLAMA_KVQ_KEY_CACHE_KV_HEAVY);
    }

    // (a q53_64 file's pairs are laid out by importance, "importance": its halves keep their own 32-wide Hadamards)
    if (kvq.attn_rot_k == LLAMA_ATTN_ROT_TYPE_AUTO && key(LLAMA_KVQ_KEY_BAKED_KSORT) == "true" &&
        key(LLAMA_KVQ_KEY_BAKED_KSORT_KEY) != "importance") {
        kvq.attn_rot_k = LLAMA_ATTN_ROT_TYPE_DISABLED;
        LLAMA_LOG_INFO("%s: online K rotation off: the GGUF's keys are K-sorted and a Hadamard would undo it (force with attn_rot_k/-rotk on)\n", __func__);
    }
    if (kvq.attn_rot_v == LLAMA_ATTN_ROT_TYPE_AUTO && (key(LLAMA_KVQ_KEY_BAKED_ROTATE_V) == LLAMA_KVQ_VALUE_ROTATE_V_HADAMARD || key(LLAMA_KVQ_KEY_BAKED_ROTATE_V) == LLAMA_KVQ_VALUE_ROTATE_V_LEARNED)) {
        kvq.attn_rot_v = LLAMA_ATTN_ROT_TYPE_DISABLED;
        LLAMA_LOG_INFO("%s: online V rotation off: a transform (%s) is baked into W_v/W_o (force with attn_rot_v/-rotv on)\n", __func__, key(LLAMA_KVQ_KEY_BAKED_ROTATE_V).c_str());
    }
}

bool llama_kvq_check_cache_types(const llama_model & model, llama_context_params & params) {
    static const char * fn = "llama_init_from_model";   // upstream's messages, as that function logged them
    const auto & hp = model.hparams;
    const auto type_at = [&](ggml_type t, uint32_t il, bool v) { return model.kvq.cache_type(t, il, v); };
    bool v_quantized = false;
    for (uint32_t il = 0; il < hp.n_layer_all; ++il) {
        const ggml_type tk = type_at(params.type_k, il, false);
        const ggml_type tv = type_at(params.type_v, il, true);
        if ((hp.is_mla() || model.arch == LLM_ARCH_DEEPSEEK4) && tk != tv) {
            LLAMA_LOG_ERROR("%s: model does not support different K (%s) and V (%s) cache types (layer %u)\n", fn,
                            ggml_type_name(tk), ggml_type_name(tv), il);
            return false;
        }
        v_quantized = v_quantized || ggml_is_quantized(tv);
    }
    if (v_quantized && params.flash_attn_type != LLAMA_FLASH_ATTN_TYPE_ENABLED) {
        if (params.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_AUTO) {
            LLAMA_LOG_INFO("%s: enabling flash_attn since it is required for quantized V cache\n", fn);
            params.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
        }
        if (params.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_DISABLED) {
            LLAMA_LOG_ERROR("%s: quantized V cache requires flash_attn to be enabled\n", fn);
            return false;
        }
    }
    if (params.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_DISABLED) {
        return true;
    }
    for (const bool v : { false, true }) {
        for (uint32_t il = 0; il < hp.n_layer(); ++il) {
            const ggml_type t    = type_at(v ? params.type_v : params.type_k, il, v);
            const uint32_t  head = v ? hp.n_embd_head_v(il) : hp.n_embd_head_k(il);
            if (ggml_is_quantized(t) && head % ggml_blck_size(t) != 0) {
                LLAMA_LOG_ERROR("%s: %s cache type %s with block size %u does not divide n_embd_head_%s=%u (layer %u)\n",
                                fn, v ? "V" : "K", ggml_type_name(t), (unsigned) ggml_blck_size(t), v ? "v" : "k", head, il);
                return false;
            }
        }
    }
    return true;
}
