// pykvq: the llama side's own state and public functions (native/include/llama-kvq-api.h).
//
// llama_context_params stays upstream's, so pykvq's per-context settings reach the llama_context
// constructor through a thread-local scope that llama_init_from_model opens around it.
#include "llama-kvq.h"

#include "llama-context.h"
#include "llama-kvq-cache.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

//
// per-context settings: one row per setting (the tools' flags, llama-bench's variables and pykvq's are made from it);
// a new one is a row here, a field of llama_kvq_ctx_opts and its reader
//

namespace {

struct kvq_setting {
    const char * name;
    const char * env;      // the variable the tools' flag falls back to (nullptr: none); the library reads none
    const char * values;   // what it takes, for messages and --help
    bool (*parse)(llama_kvq_ctx_opts & o, const char * v);   // false: not a value it takes
    const char * flags;    // the tools' flag and its aliases, comma-separated (common/arg.cpp makes them from here)
    const char * hint;     // the flag's value in --help
    const char * help;
};

bool kvq_parse_rot(llama_attn_rot_type & r, const char * v) {
    if (strcmp(v, "auto") == 0) { r = LLAMA_ATTN_ROT_TYPE_AUTO;     return true; }
    if (strcmp(v, "on")   == 0) { r = LLAMA_ATTN_ROT_TYPE_ENABLED;  return true; }
    if (strcmp(v, "off")  == 0) { r = LLAMA_ATTN_ROT_TYPE_DISABLED; return true; }
    return false;
}

bool kvq_parse_count(int & n, const char * v) {
    char * end = nullptr;
    const long x = strtol(v, &end, 10);
    n = (int) x;
    return end != v && *end == '\0' && x >= 0 && x <= (1 << 20);
}

int kvq_index_of(const char * v, std::initializer_list<const char *> names) {
    int i = 0;
    for (const char * n : names) {
        if (strcmp(v, n) == 0) {
            return i;
        }
        ++i;
    }
    return -1;
}

const kvq_setting k_settings[] = {
    { "attn_rot_k", nullptr, "auto, on or off",
      [](llama_kvq_ctx_opts & o, const char * v) { return kvq_parse_rot(o.attn_rot_k, v); },
      "-rotk,--attn-rot-k", "{auto,on,off}",
      "online Hadamard rotation of the K cache (default: auto = on for quantized K with head size % 64 == 0)" },
    { "attn_rot_v", nullptr, "auto, on or off",
      [](llama_kvq_ctx_opts & o, const char * v) { return kvq_parse_rot(o.attn_rot_v, v); },
      "-rotv,--attn-rot-v", "{auto,on,off}",
      "online Hadamard rotation of the V cache (default: auto = on for quantized V with head size % 64 == 0)" },
    { "k_domain", "PYKVQ_K_DOMAIN", "auto, post, pre or centred",
      [](llama_kvq_ctx_opts & o, const char * v) {
          const int i = kvq_index_of(v, { "auto", "post", "pre", "centred" });
          o.k_domain = i - 1;   // LLAMA_KVQ_K_DOMAIN_AUTO = -1, POST, PRE, CENTRED
          return i >= 0;
      },
      "--kv-domain", "{auto,post,pre,centred}",
      "where a --prerope-k file's quantized keys are cached (default: auto = pre-RoPE where the file asks)" },
    { "encoder", "PYKVQ_ENCODER", "auto, stock or lsq",
      [](llama_kvq_ctx_opts & o, const char * v) {
          const int i = kvq_index_of(v, { "auto", "stock", "lsq" });
          o.encoder = i == 1 ? GGML_KVQ_ENCODER_STOCK : i == 2 ? GGML_KVQ_ENCODER_LSQ : -1;
          return i >= 0;
      },
      "--kv-encoder", "{auto,stock,lsq}",
      "encoder of q4_0 / q5_0 cache rows (default: auto = least-squares scales for a pykvq-converted file)" },
    { "k_centre_residual", "PYKVQ_K_CENTRE_RESIDUAL", "a number >= 0",
      [](llama_kvq_ctx_opts & o, const char * v) {
          char * end = nullptr;
          const double x = strtod(v, &end);
          o.centre_residual = x;
          return end != v && *end == '\0' && x >= 0.0 && x < 1e30;
      },
      "--kv-centre-residual", "X",
      "centred key cache: mean energy left uncorrected, x the head's variance (default: 0.5)" },
    { "kv_window", "PYKVQ_KV_WINDOW", "a number of cells >= 0",
      [](llama_kvq_ctx_opts & o, const char * v) { return kvq_parse_count(o.kv_window, v); },
      "--kv-window", "N",
      "pre-RoPE key cache: each query reads the last N positions up to it unquantized (f16) (default: the file's "
      "pykvq.cache.kv_window, 64 for a --prerope-k file; 0: off)" },
    { "kv_sinks", "PYKVQ_KV_SINKS", "a number of positions >= 0",
      [](llama_kvq_ctx_opts & o, const char * v) { return kvq_parse_count(o.kv_sinks, v); },
      "--kv-sinks", "N",
      "pre-RoPE key cache: keep the first N positions (attention sinks) unquantized (f16) (default: the file's "
      "pykvq.cache.kv_sinks, 4 for a --prerope-k file; 0: off)" },
    { "kv_window_type", "PYKVQ_KV_WINDOW_TYPE", "f16 or q8_0",
      [](llama_kvq_ctx_opts & o, const char * v) {
          const int i = kvq_index_of(v, { "f16", "q8_0" });
          o.kv_window_type = i == 0 ? GGML_TYPE_F16 : i == 1 ? GGML_TYPE_Q8_0 : -1;
          return i >= 0;
      },
      "--kv-window-type", "{f16,q8_0}",
      "how the exact window's and sinks' rows are held: f16, or q8_0 at about half the bytes, in layers the CPU "
      "or CUDA attends (default: the file's pykvq.cache.kv_window_type, else f16)" },
    { "kv_heavy", "PYKVQ_KV_HEAVY", "a fraction of the context in [0, 1]",
      [](llama_kvq_ctx_opts & o, const char * v) {
          char * end = nullptr;
          const double x = strtod(v, &end);
          o.kv_heavy = x;
          return end != v && *end == '\0' && x >= 0.0 && x <= 1.0;
      },
      "--kv-heavy", "F",
      "pre-RoPE key cache with an exact window: also keep this fraction of each sequence's cells exact, the keys "
      "scoring highest against the file's mean query (heavy hitters; e.g. 0.01; needs blk.N.kvq_q_mean; default: the "
      "file's pykvq.cache.kv_heavy, else 0)" },
};
constexpr int k_n_settings = (int) (sizeof(k_settings) / sizeof(k_settings[0]));

int kvq_setting_index(const char * name) {
    for (int i = 0; name != nullptr && i < k_n_settings; ++i) {
        if (strcmp(k_settings[i].name, name) == 0) {
            return i;
        }
    }
    return -1;
}

thread_local std::string t_error;

} // namespace

// settings given by name, kept as text: a context parses each at creation (kvq_resolve)
struct llama_kvq_params {
    std::string value[k_n_settings];
    bool        given[k_n_settings] = {};

    bool set(const char * name, const char * v) {
        const int i = kvq_setting_index(name);
        if (i < 0) {
            std::string all;
            for (const auto & s : k_settings) {
                all += std::string(all.empty() ? "" : ", ") + s.name;
            }
            t_error = std::string("unknown pykvq setting '") + (name ? name : "(null)") + "' (known: " + all + ")";
            return false;
        }
        llama_kvq_ctx_opts scratch;
        if (v == nullptr || !k_settings[i].parse(scratch, v)) {
            t_error = std::string(name) + " = '" + (v ? v : "(null)") + "': expected " + k_settings[i].values;
            return false;
        }
        value[i] = v;
        given[i] = true;
        return true;
    }
};

namespace {

std::mutex g_defaults_mutex;
llama_kvq_params g_defaults;                                        // llama_kvq_set_default: the tools' flags

const char * kvq_rot_str(llama_attn_rot_type r) {
    return r == LLAMA_ATTN_ROT_TYPE_ENABLED ? "on" : r == LLAMA_ATTN_ROT_TYPE_DISABLED ? "off" : "auto";
}

} // namespace

llama_kvq_params * llama_kvq_params_init(void) {
    return new llama_kvq_params();
}

void llama_kvq_params_free(llama_kvq_params * params) {
    delete params;
}

bool llama_kvq_params_set(llama_kvq_params * params, const char * name, const char * value) {
    return params != nullptr && params->set(name, value);
}

bool llama_kvq_set_default(const char * name, const char * value) {
    std::lock_guard<std::mutex> lock(g_defaults_mutex);
    return g_defaults.set(name, value);
}

int32_t llama_kvq_setting_count(void) {
    return k_n_settings;
}

// one column of the table by row (nullptr past the last row)
static const char * kvq_setting_column(int32_t i, const char * kvq_setting::*column) {
    return i >= 0 && i < k_n_settings ? k_settings[i].*column : nullptr;
}

const char * llama_kvq_setting_name(int32_t i)   { return kvq_setting_column(i, &kvq_setting::name); }
const char * llama_kvq_setting_values(int32_t i) { return kvq_setting_column(i, &kvq_setting::values); }
const char * llama_kvq_setting_env(int32_t i)    { return kvq_setting_column(i, &kvq_setting::env); }
const char * llama_kvq_setting_flags(int32_t i)  { return kvq_setting_column(i, &kvq_setting::flags); }
const char * llama_kvq_setting_hint(int32_t i)   { return kvq_setting_column(i, &kvq_setting::hint); }
const char * llama_kvq_setting_help(int32_t i)   { return kvq_setting_column(i, &kvq_setting::help); }

const char * llama_kvq_settings_error(void) {
    return t_error.c_str();
}

// a context's settings: each from the request, else the process default, else auto. The environment is the callers'
// fallback (the tools' --kv-* flags read PYKVQ_*, as upstream's set_env; pykvq.Model does the same), never read here.
// Values were checked when they were set, so parsing cannot fail.
static llama_kvq_ctx_opts kvq_resolve(const llama_kvq_params * request) {
    llama_kvq_params defaults;
    {
        std::lock_guard<std::mutex> lock(g_defaults_mutex);
        defaults = g_defaults;
    }
    llama_kvq_ctx_opts opts;
    for (int i = 0; i < k_n_settings; ++i) {
        const char * v = request != nullptr && request->given[i] ? request->value[i].c_str()
                       : defaults.given[i]                       ? defaults.value[i].c_str() : nullptr;
        if (v != nullptr) {
            k_settings[i].parse(opts, v);
        }
    }
    return opts;
}

llama_context * llama_kvq_init_from_model_params(llama_model * model, llama_context_params params, const llama_kvq_params * kvq) {
    return llama_init_from_model(model, params, kvq_resolve(kvq));
}

llama_context * llama_kvq_init_from_model(llama_model * model, llama_context_params params,
                                          enum llama_attn_rot_type attn_rot_k, enum llama_attn_rot_type attn_rot_v) {
    llama_kvq_params kvq;
    kvq.set("attn_rot_k", kvq_rot_str(attn_rot_k));
    kvq.set("attn_rot_v", kvq_rot_str(attn_rot_v));
    return llama_kvq_init_from_model_params(model, params, &kvq);
}

//
// what a model file asks for, what a context holds
//

int32_t llama_kvq_model_n_layer_types(const llama_model * model, bool v) {
    return model ? (int32_t) model->kvq.layer_types[v ? 1 : 0].size() : 0;
}

int32_t llama_kvq_attn_rot(const llama_context * ctx, bool v) {
    if (!ctx || !ctx->get_memory()) {
        return -1;
    }
    for (const auto & d : llama_memory_kvq_layers(ctx->get_memory(), ctx->get_model().hparams.n_layer_all)) {
        if ((v ? d.type_v : d.type_k) >= 0) {
            return (v ? d.rot_v : d.rot_k) ? 1 : 0;
        }
    }
    return -1;
}

int32_t llama_kvq_layer_type(const llama_context * ctx, int32_t il, bool v) {
    if (!ctx || il < 0 || !ctx->get_memory()) {
        return -1;
    }
    const auto layers = llama_memory_kvq_layers(ctx->get_memory(), ctx->get_model().hparams.n_layer_all);
    if ((size_t) il >= layers.size()) {
        return -1;
    }
    return v ? layers[il].type_v : layers[il].type_k;
}

int32_t llama_kvq_codebook_source(const llama_context * ctx, int32_t il, bool v) {
    if (!ctx || il < 0 || !ctx->get_memory()) {
        return 0;
    }
    const auto layers = llama_memory_kvq_layers(ctx->get_memory(), ctx->get_model().hparams.n_layer_all);
    if ((size_t) il >= layers.size()) {
        return 0;
    }
    return v ? layers[il].cb_v : layers[il].cb_k;
}

int32_t llama_kvq_memory_used_cells(const llama_context * ctx, llama_seq_id seq_id) {
    if (!ctx || !ctx->get_memory()) {
        return -1;
    }
    return llama_memory_kvq_used_cells(ctx->get_memory(), seq_id);
}

int32_t llama_kvq_get(const llama_context * ctx, const char * name, char * buf, size_t size) {
    if (!ctx || !ctx->get_memory() || name == nullptr) {
        return -1;
    }
    const auto layers = llama_memory_kvq_layers(ctx->get_memory(), ctx->get_model().hparams.n_layer_all);
    const llama_kvq_layer_desc * first = nullptr;   // the first layer with an attention KV cache
    int n_pre = 0, n_centred = 0;
    for (const auto & d : layers) {
        if (d.type_k < 0) {
            continue;
        }
        first = first ? first : &d;
        n_pre     += d.k_domain == LLAMA_KVQ_K_DOMAIN_PRE;
        n_centred += d.k_domain == LLAMA_KVQ_K_DOMAIN_CENTRED;
    }
    if (first == nullptr) {
        return -1;
    }
    const char * v = nullptr;
    const bool sinks = strcmp(name, "kv_sinks") == 0;
    if (sinks || strcmp(name, "kv_window") == 0) {
        // the largest any of the memory's caches keeps (0: none, e.g. post-RoPE keys or a device-held cache)
        uint32_t n = 0;
        llama_kvq_for_each_kv_cache(ctx->get_memory(), [&](llama_kv_cache & kv) {
            const auto [s, w] = llama_kvq_cache::of(kv).window_size();
            n = std::max(n, sinks ? s : w);
        });
        return snprintf(buf, buf ? size : 0, "%u", n);
    }
    if (strcmp(name, "kv_heavy") == 0) {
        // heavy-hitter slots per sequence, the most any of the memory's caches keeps (0: none)
        uint32_t n = 0;
        llama_kvq_for_each_kv_cache(ctx->get_memory(), [&](llama_kv_cache & kv) {
            n = std::max(n, llama_kvq_cache::of(kv).heavy_size());
        });
        return snprintf(buf, buf ? size : 0, "%u", n);
    }
    if (strcmp(name, "kv_window_type") == 0) {
        // q8_0 where any cache holds q8_0 rows, f16 where all hold f16, "" where none keeps a window
        v = "";
        llama_kvq_for_each_kv_cache(ctx->get_memory(), [&](llama_kv_cache & kv) {
            const char * t = llama_kvq_cache::of(kv).window_type();
            v = *v == '\0' || strcmp(t, "q8_0") == 0 ? t : v;
        });
        return snprintf(buf, buf ? size : 0, "%s", v);
    }
    if (strcmp(name, "k_domain") == 0) {
        v = n_pre > 0 ? "pre" : n_centred > 0 ? "centred" : "post";
    } else if (strcmp(name, "encoder") == 0) {
        v = first->encoder == GGML_KVQ_ENCODER_LSQ ? "lsq" : "stock";
    } else if (strcmp(name, "attn_rot_k") == 0 || strcmp(name, "attn_rot_v") == 0) {
        v = llama_kvq_attn_rot(ctx, name[9] == 'v') == 1 ? "on" : "off";
    } else {
        return -1;
    }
    return snprintf(buf, buf ? size : 0, "%s", v);
}
