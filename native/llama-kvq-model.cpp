// pykvq: what a converted GGUF asks of the runtime: its pykvq.cache.* keys (per-layer types, codebook
// calibration, key domain), host copies of the nuq codebooks, and the defaults a context takes from them.
// The llama_model methods are declared in src/llama-model.h (patch 0006); their bodies live here.
#include "llama-kvq.h"
#include "llama-kvq-keys.h"

#include "llama-impl.h"
#include "llama-model.h"

#include <stdexcept>
#include <string>

void llama_kvq_load_cache_keys(llama_model & model, const gguf_context * ctx) {
    auto & kvq = model.kvq;
    const auto & gguf_kv = model.gguf_kv;
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
                const char * name = gguf_get_arr_str(ctx, kid, i);
                const ggml_type t = llama_kvq_type_from_name(name);
                if (t == GGML_TYPE_COUNT) {
                    LLAMA_LOG_WARN("%s: %s[%zu] = '%s' is not a type this build knows; that layer's cache is f16\n", __func__, key_layers, i, name);
                }
                kvq.layer_types[v].push_back(t == GGML_TYPE_COUNT ? GGML_TYPE_F16 : t);
            }
        }
        const auto it = gguf_kv.find(key_type);
        kvq.file_type[v] = it == gguf_kv.end() ? GGML_TYPE_COUNT : llama_kvq_type_from_name(it->second.c_str());
        const auto ir = gguf_kv.find(key_rot);
        kvq.codebook_rot[v] = ir == gguf_kv.end() ? -1 : ir->second == "true" ? 1 : 0;
    }
    const auto it = gguf_kv.find(LLAMA_KVQ_KEY_CACHE_K_DOMAIN);
    if (it != gguf_kv.end() && it->second != LLAMA_KVQ_VALUE_K_DOMAIN_PREROPE && it->second != LLAMA_KVQ_VALUE_K_DOMAIN_POSTROPE) {
        throw std::runtime_error(format(LLAMA_KVQ_KEY_CACHE_K_DOMAIN " = '%s': expected " LLAMA_KVQ_VALUE_K_DOMAIN_PREROPE " or " LLAMA_KVQ_VALUE_K_DOMAIN_POSTROPE, it->second.c_str()));
    }
    kvq.k_prerope = it != gguf_kv.end() && it->second == LLAMA_KVQ_VALUE_K_DOMAIN_PREROPE;
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
            model.kvq.has_codebook[v][il] = 1;
        }
    }
}

const int8_t * llama_kvq_layer_codebook(const llama_model & model, int il, bool v, ggml_type type) {
    const int8_t * cb = model.kvq_codebook(il, v, type);
    if (cb != nullptr && !llama_kvq_codebook_ok(cb, type)) {
        throw std::runtime_error(format("blk.%d.kvq_codebook_%c is not a valid %s codebook (%d entries strictly ascending in [-127, 127])",
                il, v ? 'v' : 'k', ggml_type_name(type), llama_kvq_n_codes(type)));
    }
    return cb;
}

ggml_type llama_model::kvq_cache_type(ggml_type requested, uint32_t il, bool v) const {
    if (requested != LLAMA_KV_CACHE_TYPE_MODEL) {
        return requested;
    }
    const auto & lt = kvq.layer_types[v];
    if (il < lt.size()) {
        return lt[il];
    }
    return kvq.file_type[v] != GGML_TYPE_COUNT ? kvq.file_type[v] : GGML_TYPE_F16;
}

ggml_type llama_model::kvq_calibrated_type(uint32_t il, bool v) const {
    const auto & lt = kvq.layer_types[v];
    return il < lt.size() ? lt[il] : kvq.file_type[v];
}

const int8_t * llama_model::kvq_codebook(uint32_t il, bool v, ggml_type type) const {
    if (!llama_kvq_is_nuq(type) || il >= kvq.has_codebook[v].size() || !kvq.has_codebook[v][il]) {
        return nullptr;
    }
    return kvq_calibrated_type(il, v) == type ? kvq.codebook[v][il].data() : nullptr;
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
                        ggml_type_name(model.kvq_cache_type(LLAMA_KV_CACHE_TYPE_MODEL, n_layer, is_v)));
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

    if (kvq.attn_rot_k == LLAMA_ATTN_ROT_TYPE_AUTO && key(LLAMA_KVQ_KEY_BAKED_KSORT) == "true") {
        kvq.attn_rot_k = LLAMA_ATTN_ROT_TYPE_DISABLED;
        LLAMA_LOG_INFO("%s: online K rotation off: the GGUF's keys are K-sorted and a Hadamard would undo it (force with attn_rot_k/-rotk on)\n", __func__);
    }
    if (kvq.attn_rot_v == LLAMA_ATTN_ROT_TYPE_AUTO && (key(LLAMA_KVQ_KEY_BAKED_ROTATE_V) == LLAMA_KVQ_VALUE_ROTATE_V_HADAMARD || key(LLAMA_KVQ_KEY_BAKED_ROTATE_V) == LLAMA_KVQ_VALUE_ROTATE_V_LEARNED)) {
        kvq.attn_rot_v = LLAMA_ATTN_ROT_TYPE_DISABLED;
        LLAMA_LOG_INFO("%s: online V rotation off: a transform (%s) is baked into W_v/W_o (force with attn_rot_v/-rotv on)\n", __func__, key(LLAMA_KVQ_KEY_BAKED_ROTATE_V).c_str());
    }
}
