#pragma once

// pykvq's public C API on top of llama.h. llama.h itself stays byte-for-byte upstream's, so bindings built
// against upstream (llama-cpp-python's ctypes structs among them) load this library unchanged; every
// pykvq setting goes through the llama_kvq_* functions below.

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// type_k / type_v value meaning "what the GGUF's pykvq.cache.type_k/v (or layer_types_k/v) asks for, else f16"
#define LLAMA_KV_CACHE_TYPE_MODEL GGML_TYPE_COUNT

// online Hadamard rotation of the K / V cache (upstream: only the LLAMA_ATTN_ROT_DISABLE environment variable)
enum llama_attn_rot_type {
    LLAMA_ATTN_ROT_TYPE_AUTO     = -1, // upstream's rule, unless the GGUF's baked transforms turn it off
    LLAMA_ATTN_ROT_TYPE_DISABLED = 0,
    LLAMA_ATTN_ROT_TYPE_ENABLED  = 1,
};

// llama_init_from_model with pykvq's per-context settings (llama_init_from_model takes the process default)
LLAMA_API struct llama_context * llama_kvq_init_from_model(
        struct llama_model * model, struct llama_context_params params,
        enum llama_attn_rot_type attn_rot_k, enum llama_attn_rot_type attn_rot_v);

// ---- per-context settings by name (native/llama/llama-kvq.cpp holds the table) -------------------------------------
//   attn_rot_k, attn_rot_v  auto | on | off        the online Hadamard rotation of the K / V cache
//   k_domain                auto | post | pre | centred   where a --prerope-k file's quantized keys are cached
//   encoder                 auto | stock | lsq     how q4_0 / q5_0 cache rows are written (auto: lsq for a converted file)
//   k_centre_residual       a number >= 0          the mean energy a centred cache may leave uncorrected (x the variance)
//   kv_window, kv_sinks     a number >= 0          the exact window of a pre-RoPE cache: last cells, first positions
//   kv_window_type          f16 | q8_0             its rows' type (q8_0 where the CPU or CUDA attends; RPC keeps f16)
//   kv_heavy                a fraction in [0, 1]   and this share of each sequence's cells: the heavy hitters
// A context takes each setting from the llama_kvq_params it is made with, else the process default
// (llama_kvq_set_default: the tools' flags), else auto. The library reads no environment variable for them: the
// tools' --kv-* flags fall back to PYKVQ_* variables (llama_kvq_setting_env; as upstream's set_env), llama-bench reads
// the same variables, and pykvq (Model, use_with_llama_cpp) does the same on the Python side.
struct llama_kvq_params;

LLAMA_API struct llama_kvq_params * llama_kvq_params_init(void);       // every setting left to the defaults
LLAMA_API void llama_kvq_params_free(struct llama_kvq_params * params);
// false for an unknown name or a value the setting does not take (llama_kvq_settings_error says which)
LLAMA_API bool llama_kvq_params_set(struct llama_kvq_params * params, const char * name, const char * value);
LLAMA_API bool llama_kvq_set_default(const char * name, const char * value);
LLAMA_API const char * llama_kvq_settings_error(void);                 // the last refusal on this thread

// the table itself, for tools and bindings: setting i's name, the values it takes, and the environment variable a
// tool's flag falls back to (NULL: none); NULL past the last one
LLAMA_API int32_t      llama_kvq_setting_count(void);
LLAMA_API const char * llama_kvq_setting_name(int32_t i);
LLAMA_API const char * llama_kvq_setting_values(int32_t i);
LLAMA_API const char * llama_kvq_setting_env(int32_t i);
// the tools' flag of setting i (comma-separated aliases), its value in --help and its help: common/arg.cpp makes
// every flag from these (a tool flag with no variable of its own falls back to LLAMA_ARG_<NAME>)
LLAMA_API const char * llama_kvq_setting_flags(int32_t i);
LLAMA_API const char * llama_kvq_setting_hint(int32_t i);
LLAMA_API const char * llama_kvq_setting_help(int32_t i);

// llama_init_from_model with the settings of kvq (NULL: the defaults)
LLAMA_API struct llama_context * llama_kvq_init_from_model_params(
        struct llama_model * model, struct llama_context_params params, const struct llama_kvq_params * kvq);

// what context ctx really runs for a setting, as text in buf: k_domain "pre" / "centred" / "post" (any layer
// pre-RoPE or centred, else post), encoder "lsq" / "stock", attn_rot_k / _v "on" / "off", kv_sinks / kv_window the
// exact window's sizes ("0": none, e.g. post-RoPE keys or a cache on a GPU), kv_window_type its rows' ("q8_0" where any
// layer holds q8_0 rows, "" without a window), kv_heavy the heavy-hitter slots per sequence ("0": none). Returns the length
// (snprintf's), -1 for a name it cannot answer or a context without an attention KV cache
LLAMA_API int32_t llama_kvq_get(const struct llama_context * ctx, const char * name, char * buf, size_t size);

// ggml type id of layer il's K (v = false) or V cache, -1 if the layer has no KV cache
LLAMA_API int32_t llama_kvq_layer_type(const struct llama_context * ctx, int32_t il, bool v);

// where layer il's K / V nuq codebook comes from: 0 not a nuq cache, 1 the model file, 2 the type's fallback
LLAMA_API int32_t llama_kvq_codebook_source(const struct llama_context * ctx, int32_t il, bool v);

// entries of the GGUF's per-layer cache types pykvq.cache.layer_types_k (v = false) / _v, 0 when absent
LLAMA_API int32_t llama_kvq_model_n_layer_types(const struct llama_model * model, bool v);

// whether the online Hadamard rotation of the K (v = false) or V cache is on: 1 on, 0 off, -1 no KV cache
LLAMA_API int32_t llama_kvq_attn_rot(const struct llama_context * ctx, bool v);

// cells of the context's attention KV caches in use: those holding sequence seq_id, or with seq_id < 0 those any
// sequence holds. Summed over every stream (a non-unified cache has one per sequence) and every attention cache of
// the memory (an iSWA memory's base and SWA caches both); a cell shared by copied sequences counts once in the
// total. -1 when the context has no attention KV cache or seq_id is out of range.
LLAMA_API int32_t llama_kvq_memory_used_cells(const struct llama_context * ctx, llama_seq_id seq_id);


// ---- runtime calibration (native/llama/llama-kvq-calib.cpp; pykvq.calibrate) ---------------------------------------
// Per layer: statistics of Q and K before RoPE (src[0] of the ROPE nodes named Qcur-<il> / Kcur-<il>) and of V,
// gathered by the graph's eval callback while the context decodes calibration text, as llama-imatrix does.
struct llama_kvq_calib;

LLAMA_API struct llama_kvq_calib * llama_kvq_calib_init(bool keep_samples);
LLAMA_API void llama_kvq_calib_free(struct llama_kvq_calib * calib);

// make params feed calib: sets params->cb_eval / cb_eval_user_data (a context made with them collects)
LLAMA_API void llama_kvq_calib_attach(struct llama_kvq_calib * calib, struct llama_context_params * params);

// the callback itself (ggml_backend_sched_eval_callback), for callers that chain it behind their own
LLAMA_API bool llama_kvq_calib_eval_cb(struct ggml_tensor * t, bool ask, void * user_data);

// after each llama_decode: settles the batch (V per layer); false once anything failed (llama_kvq_calib_error)
LLAMA_API bool llama_kvq_calib_end_batch(struct llama_kvq_calib * calib);
LLAMA_API const char * llama_kvq_calib_error(const struct llama_kvq_calib * calib);

// the K ROPE nodes' mode (GGML_ROPE_TYPE_*: 0 normal, 2 neox, ...) and rotated dims; false before any
LLAMA_API bool llama_kvq_calib_rope(const struct llama_kvq_calib * calib, int32_t * mode, int32_t * n_dims);

// layers seen; the shape gathered for layer il's which (0 q, 1 k, 2 v): false when none
LLAMA_API int32_t llama_kvq_calib_n_layer(const struct llama_kvq_calib * calib);
LLAMA_API bool llama_kvq_calib_shape(const struct llama_kvq_calib * calib, int32_t il, int32_t which,
                                     int64_t * head_dim, int64_t * n_head, int64_t * n_tokens);

// copy a statistic of layer il's which, per [n_head, head_dim] channel: "sum", "sq" (double), "min", "max" (float),
// or "samples" (float [n_tokens, n_head, head_dim], kept with keep_samples). dst NULL: the element count. -1: unknown
LLAMA_API int64_t llama_kvq_calib_get(const struct llama_kvq_calib * calib, int32_t il, int32_t which,
                                      const char * what, void * dst, int64_t capacity);

// ---- sensitivity probes (native/llama/llama-kvq-probe.cpp; pykvq.sensitivity) ---------------------------------------
// Gaussian noise of a given standard deviation per [n_head_kv, head_dim] channel added to one layer's K (the output
// of the ROPE node Kcur-<il>) or V (its first Vcur-<il> node per batch) as the graph computes it: the change of the
// output distribution prices an error in that cache slot. A context made with attached params runs on the CPU.
struct llama_kvq_probe;

LLAMA_API struct llama_kvq_probe * llama_kvq_probe_init(void);
LLAMA_API void llama_kvq_probe_free(struct llama_kvq_probe * probe);
LLAMA_API void llama_kvq_probe_attach(struct llama_kvq_probe * probe, struct llama_context_params * params);
LLAMA_API bool llama_kvq_probe_eval_cb(struct ggml_tensor * t, bool ask, void * user_data);

// perturb layer il's which (1 K, 2 V) by sigma [n] (n = n_head_kv * head_dim); il < 0: no noise. Resets the hits.
LLAMA_API bool llama_kvq_probe_set(struct llama_kvq_probe * probe, int32_t il, int32_t which, const float * sigma,
                                   int64_t n, uint64_t seed);
// or add delta [n] (a whole batch's K ROPE output or V projection; kept by the caller until the decode) to the next
// batch's tensor; hits are kept, so a caller setting one delta per sequence counts them all
LLAMA_API bool llama_kvq_probe_set_delta(struct llama_kvq_probe * probe, int32_t il, int32_t which,
                                         const float * delta, int64_t n);
// before each llama_decode after the first: a new batch (its own noise from seed)
LLAMA_API void llama_kvq_probe_next_batch(struct llama_kvq_probe * probe, uint64_t seed);
// tensors changed since the last set (0 after a decode: the model names its K / V otherwise); the last error
LLAMA_API int64_t llama_kvq_probe_hits(const struct llama_kvq_probe * probe);
LLAMA_API const char * llama_kvq_probe_error(const struct llama_kvq_probe * probe);

#ifdef __cplusplus
}
#endif
