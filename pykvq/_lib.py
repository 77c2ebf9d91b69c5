"""cffi (ABI mode) binding to the patched libllama built under build/bin.

Only the slice of llama.h / ggml.h that pykvq uses is declared. Struct layouts
follow the pinned llama.cpp (llama-cpp-python 0.3.36); enums are declared as
their underlying int. The library is found via $PYKVQ_LIB, next to the package
(pykvq/lib/), or in the repository's build/bin.
"""
from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

from cffi import FFI

from . import log
from .errors import LibraryNotFoundError

CDEF = r"""
typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;
struct llama_model;
struct llama_context;
struct llama_vocab;
struct llama_sampler;
struct llama_memory_i;
typedef struct llama_memory_i * llama_memory_t;

typedef bool (*llama_progress_callback)(float progress, void * user_data);
typedef void (*ggml_log_callback)(int level, const char * text, void * user_data);

struct llama_model_params {
    void * devices;
    const void * tensor_buft_overrides;
    int32_t n_gpu_layers;
    int split_mode;
    int load_mode;
    int lazy_mode;
    int32_t main_gpu;
    const float * tensor_split;
    llama_progress_callback progress_callback;
    void * progress_callback_user_data;
    const void * kv_overrides;
    bool vocab_only;
    bool check_tensors;
    bool use_extra_bufts;
    bool no_host;
    bool no_alloc;
    bool load_mtp;
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    uint32_t n_rs_seq;
    uint32_t n_outputs_max;
    uint32_t n_outputs_max_per_seq;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    int ctx_type;
    int rope_scaling_type;
    int pooling_type;
    int attention_type;
    int flash_attn_type;
    float    rope_freq_base;
    float    rope_freq_scale;
    float    yarn_ext_factor;
    float    yarn_attn_factor;
    float    yarn_beta_fast;
    float    yarn_beta_slow;
    uint32_t yarn_orig_ctx;
    float    defrag_thold;
    void * cb_eval;
    void * cb_eval_user_data;
    int type_k;
    int type_v;
    void * abort_callback;
    void * abort_callback_data;
    bool embeddings;
    bool offload_kqv;
    bool no_perf;
    bool op_offload;
    bool swa_full;
    bool kv_unified;
    void * samplers;
    size_t n_samplers;
    struct llama_context * ctx_other;
};

typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

typedef struct llama_sampler_chain_params { bool no_perf; } llama_sampler_chain_params;
typedef struct llama_chat_message { const char * role; const char * content; } llama_chat_message;

void llama_backend_init(void);
void llama_log_set(ggml_log_callback log_callback, void * user_data);
const char * llama_print_system_info(void);

struct llama_model_params   llama_model_default_params(void);
struct llama_context_params llama_context_default_params(void);
struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);
void llama_free(struct llama_context * ctx);

uint32_t llama_n_ctx(const struct llama_context * ctx);
uint32_t llama_n_batch(const struct llama_context * ctx);
llama_memory_t llama_get_memory(const struct llama_context * ctx);
void llama_memory_clear(llama_memory_t mem, bool data);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id src, llama_seq_id dst, llama_pos p0, llama_pos p1);
void llama_memory_seq_add(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos delta);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);
bool llama_memory_can_shift(llama_memory_t mem);
size_t llama_state_get_size(struct llama_context * ctx);
size_t llama_state_get_data(struct llama_context * ctx, uint8_t * dst, size_t size);
size_t llama_state_set_data(struct llama_context * ctx, const uint8_t * src, size_t size);
bool llama_state_load_file(struct llama_context * ctx, const char * path_session, llama_token * tokens_out,
                           size_t n_token_capacity, size_t * n_token_count_out);
bool llama_state_save_file(struct llama_context * ctx, const char * path_session, const llama_token * tokens,
                           size_t n_token_count);
size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);
/* pykvq's public API, native/include/llama-kvq-api.h (llama.h is upstream's) */
int32_t llama_kvq_layer_type(const struct llama_context * ctx, int32_t il, bool v);
int32_t llama_kvq_codebook_source(const struct llama_context * ctx, int32_t il, bool v);
struct llama_kvq_params;
struct llama_kvq_params * llama_kvq_params_init(void);
void llama_kvq_params_free(struct llama_kvq_params * params);
bool llama_kvq_params_set(struct llama_kvq_params * params, const char * name, const char * value);
bool llama_kvq_set_default(const char * name, const char * value);
const char * llama_kvq_settings_error(void);
int32_t llama_kvq_setting_count(void);
const char * llama_kvq_setting_name(int32_t i);
const char * llama_kvq_setting_values(int32_t i);
const char * llama_kvq_setting_env(int32_t i);
struct llama_context * llama_kvq_init_from_model_params(struct llama_model * model, struct llama_context_params params,
                                                        const struct llama_kvq_params * kvq);
int32_t llama_kvq_get(const struct llama_context * ctx, const char * name, char * buf, size_t size);
int32_t llama_kvq_attn_rot(const struct llama_context * ctx, bool v);
int32_t llama_kvq_model_n_layer_types(const struct llama_model * model, bool v);
int32_t llama_kvq_memory_used_cells(const struct llama_context * ctx, llama_seq_id seq_id);
/* runtime calibration (native/llama/llama-kvq-calib.cpp; pykvq/calibrate.py); which: 0 q, 1 k, 2 v */
struct llama_kvq_calib;
struct llama_kvq_calib * llama_kvq_calib_init(bool keep_samples);
void llama_kvq_calib_free(struct llama_kvq_calib * calib);
void llama_kvq_calib_attach(struct llama_kvq_calib * calib, struct llama_context_params * params);
bool llama_kvq_calib_end_batch(struct llama_kvq_calib * calib);
const char * llama_kvq_calib_error(const struct llama_kvq_calib * calib);
int32_t llama_kvq_calib_n_layer(const struct llama_kvq_calib * calib);
bool llama_kvq_calib_rope(const struct llama_kvq_calib * calib, int32_t * mode, int32_t * n_dims);
bool llama_kvq_calib_shape(const struct llama_kvq_calib * calib, int32_t il, int32_t which,
                           int64_t * head_dim, int64_t * n_head, int64_t * n_tokens);
int64_t llama_kvq_calib_get(const struct llama_kvq_calib * calib, int32_t il, int32_t which, const char * what,
                            void * dst, int64_t capacity);
/* sensitivity probes (native/llama/llama-kvq-probe.cpp; pykvq/sensitivity.py); which: 1 k, 2 v */
struct llama_kvq_probe;
struct llama_kvq_probe * llama_kvq_probe_init(void);
void llama_kvq_probe_free(struct llama_kvq_probe * probe);
void llama_kvq_probe_attach(struct llama_kvq_probe * probe, struct llama_context_params * params);
bool llama_kvq_probe_set(struct llama_kvq_probe * probe, int32_t il, int32_t which, const float * sigma, int64_t n,
                         uint64_t seed);
bool llama_kvq_probe_set_delta(struct llama_kvq_probe * probe, int32_t il, int32_t which, const float * delta,
                               int64_t n);
void llama_kvq_probe_next_batch(struct llama_kvq_probe * probe, uint64_t seed);
int64_t llama_kvq_probe_hits(const struct llama_kvq_probe * probe);
const char * llama_kvq_probe_error(const struct llama_kvq_probe * probe);

const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t llama_model_n_embd(const struct llama_model * model);
int32_t llama_model_n_layer(const struct llama_model * model);
int32_t llama_model_n_head(const struct llama_model * model);
int32_t llama_model_n_head_kv(const struct llama_model * model);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
const char * llama_model_chat_template(const struct llama_model * model, const char * name);

int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);

int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
                             int32_t length, int32_t lstrip, bool special);
int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                         char * text, int32_t text_len_max, bool remove_special, bool unparse_special);
int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                  bool add_ass, char * buf, int32_t length);

struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(struct llama_batch batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
float * llama_get_logits(struct llama_context * ctx);

struct llama_sampler_chain_params llama_sampler_chain_default_params(void);
struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
void llama_sampler_free(struct llama_sampler * smpl);

const char * ggml_type_name(int type);
size_t ggml_row_size(int type, int64_t ne);
int64_t ggml_blck_size(int type);
/* ggml's own row decoders (convert/weights_f32.py): upstream's struct, field for field */
typedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k);
typedef void (*ggml_from_float_t)(const float * x, void * y, int64_t k);
struct ggml_type_traits {
    const char * type_name; int64_t blck_size; int64_t blck_size_interleave; size_t type_size; bool is_quantized;
    ggml_to_float_t to_float; ggml_from_float_t from_float_ref;
};
const struct ggml_type_traits * ggml_get_type_traits(int type);

"""

LIB_NAME = "libllama.so"
_PKG_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _PKG_DIR.parent

ffi = FFI()
ffi.cdef(CDEF)

_lib = None
_lock = threading.Lock()
_log_callback = None  # the cffi callback must stay referenced while the lib is loaded


def candidate_paths() -> list[Path]:
    env = os.environ.get("PYKVQ_LIB")
    if env:
        p = Path(env)
        return [p / LIB_NAME if p.is_dir() else p]
    return [_PKG_DIR / "lib" / LIB_NAME, _REPO_ROOT / "build" / "bin" / LIB_NAME]


def lib_path() -> Path:
    for p in candidate_paths():
        if p.is_file():
            return p
    tried = ", ".join(str(p) for p in candidate_paths())
    raise LibraryNotFoundError(
        f"pykvq: the patched libllama is not built (looked for {tried}). "
        "Build it with 'make build' (or: cmake -S . -B build && cmake --build build -j), "
        "or point PYKVQ_LIB at a built libllama.so.")


def llama_cpp_lib_path() -> str:
    """The directory of pykvq's patched libllama, for llama-cpp-python's $LLAMA_CPP_LIB_PATH."""
    return str(lib_path().parent)


@functools.cache
def settings() -> dict[str, tuple[str, str | None]]:
    """The library's settings table (llama_kvq_setting_*): {name: (the values it takes, its PYKVQ_* variable or
    None)}, in the table's order. The tools' --kv-* flags and llama-bench fall back to the same variables. Read once:
    the table is fixed in the library (callers must not change the dict)."""
    L = lib()
    out = {}
    for i in range(L.llama_kvq_setting_count()):
        env = L.llama_kvq_setting_env(i)
        out[ffi.string(L.llama_kvq_setting_name(i)).decode()] = (
            ffi.string(L.llama_kvq_setting_values(i)).decode(), ffi.string(env).decode() if env != ffi.NULL else None)
    return out


@functools.cache
def setting_envs() -> dict[str, str]:
    """{setting: its environment variable} for the settings a caller may leave to the environment."""
    return {name: env for name, (_, env) in settings().items() if env}


def setting_from_env(name: str) -> str | None:
    """The environment's value for a pykvq setting (None when unset or the setting has no variable)."""
    env = setting_envs().get(name)
    return os.environ.get(env) if env else None


def set_setting(setter, name: str, value, *, from_env: bool = False) -> None:
    """setter(name, value) as bytes (llama_kvq_params_set on a params, llama_kvq_set_default); a refused value
    raises SettingError naming where it came from (the argument, or the environment variable)."""
    from .errors import SettingError
    if not setter(name.encode(), str(value).encode()):
        why = ffi.string(lib().llama_kvq_settings_error()).decode()
        if from_env:
            why = f"{setting_envs()[name]} = '{value}': " + why.split(": ", 1)[-1]
        raise SettingError(why)


def apply_settings(setter, values: dict) -> None:
    """set_setting for each setting given in values; one given as None, or one with a variable (setting_envs) not
    given, takes its PYKVQ_* environment variable when that is set (the callers' fallback: the library reads none)."""
    for name in dict.fromkeys([*values, *setting_envs()]):
        value, from_env = values.get(name), False
        if value is None:
            value, from_env = setting_from_env(name), True
        if value is not None:
            set_setting(setter, name, value, from_env=from_env)


def use_with_llama_cpp(**settings) -> str:
    """Point llama-cpp-python at pykvq's patched libllama: sets $LLAMA_CPP_LIB_PATH (read once, when llama_cpp
    is imported: call this first) unless it is already set; returns the directory llama_cpp will load from.

    settings (k_domain=, encoder=, k_centre_residual=, attn_rot_k=, attn_rot_v=) become the process defaults of
    every context llama_cpp makes; one not given falls back to its PYKVQ_* environment variable."""
    path = os.environ.setdefault("LLAMA_CPP_LIB_PATH", llama_cpp_lib_path())
    # the library llama_cpp loads is this one: one copy per process, one set of defaults
    apply_settings(lambda n, v: lib().llama_kvq_set_default(n, v), settings)
    return path


def lib():
    """The loaded library (loaded and initialised once per process)."""
    global _lib
    with _lock:
        if _lib is None:
            path = lib_path()
            # libllama links libggml*.so from the same directory (RUNPATH $ORIGIN, CMakeLists.txt);
            # ggml-base also exports ggml_type_name & co., reachable through libllama's deps.
            ggml_base = ffi.dlopen(str(path.parent / "libggml-base.so"))
            ggml_cpu = ffi.dlopen(str(path.parent / "libggml-cpu.so"))
            lb = ffi.dlopen(str(path))
            _route_log(lb)
            lb.llama_backend_init()
            _lib = _Lib(lb, ggml_base, ggml_cpu, path)
        return _lib


def reclaim_log() -> None:
    """Point llama.cpp's log at pykvq again: another binding in the process (llama_cpp sets its own callback
    when imported) takes it over, and pykvq's errors would lose what llama.cpp said."""
    lib()._llama.llama_log_set(_log_callback, ffi.NULL)


def _route_log(lb) -> None:
    """Send llama.cpp's and ggml's log to pykvq.log."""
    global _log_callback

    @ffi.callback("void(int, const char *, void *)")
    def on_log(level, text, _user):
        log.record(level, ffi.string(text).decode("utf-8", "replace"))

    _log_callback = on_log
    lb.llama_log_set(on_log, ffi.NULL)


class _Lib:
    """libllama with libggml-base / libggml-cpu symbols reachable as attributes."""

    def __init__(self, llama, ggml_base, ggml_cpu, path: Path):
        self._llama = llama
        self._ggml = ggml_base
        self._cpu = ggml_cpu
        self.path = path

    def __getattr__(self, name):
        if name.startswith(("ggml_kvq_cpu_", "ggml_get_type_traits_cpu", "ggml_graph_compute")):
            target = self._cpu
        elif name.startswith(("ggml_", "quantize_row_", "dequantize_row_")):
            target = self._ggml
        else:
            target = self._llama
        value = getattr(target, name)
        setattr(self, name, value)
        return value
