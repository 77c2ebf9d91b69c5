// pykvq: the llama side's own state and public functions (native/include/llama-kvq-api.h).
//
// llama_context_params stays upstream's, so pykvq's per-context settings reach the llama_context
// constructor through a thread-local scope that llama_init_from_model opens around it.
#include "llama-kvq.h"

#include "llama-context.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <atomic>

//
// per-context settings
//

static std::atomic<int> g_default_rot_k{LLAMA_ATTN_ROT_TYPE_AUTO};
static std::atomic<int> g_default_rot_v{LLAMA_ATTN_ROT_TYPE_AUTO};

static thread_local const llama_kvq_ctx_opts * t_request = nullptr; // llama_kvq_init_from_model's settings
static thread_local const llama_kvq_ctx_opts * t_current = nullptr; // what the constructor being run sees

void llama_kvq_set_default_attn_rot(enum llama_attn_rot_type attn_rot_k, enum llama_attn_rot_type attn_rot_v) {
    g_default_rot_k = attn_rot_k;
    g_default_rot_v = attn_rot_v;
}

llama_context * llama_kvq_init_from_model(llama_model * model, llama_context_params params,
                                          enum llama_attn_rot_type attn_rot_k, enum llama_attn_rot_type attn_rot_v) {
    llama_kvq_ctx_opts opts;
    opts.attn_rot_k = attn_rot_k;
    opts.attn_rot_v = attn_rot_v;
    const llama_kvq_ctx_opts * prev = t_request;
    t_request = &opts;
    llama_context * ctx = llama_init_from_model(model, params);
    t_request = prev;
    return ctx;
}

llama_kvq_ctx_opts llama_kvq_ctx_opts_for_call() {
    if (t_request) {
        return *t_request;
    }
    llama_kvq_ctx_opts opts;
    opts.attn_rot_k = (llama_attn_rot_type) g_default_rot_k.load();
    opts.attn_rot_v = (llama_attn_rot_type) g_default_rot_v.load();
    return opts;
}

llama_kvq_ctx_scope::llama_kvq_ctx_scope(const llama_kvq_ctx_opts & opts) : prev(t_current) {
    t_current = &opts;
}

llama_kvq_ctx_scope::~llama_kvq_ctx_scope() {
    t_current = prev;
}

const llama_kvq_ctx_opts & llama_kvq_ctx_opts_current() {
    static const llama_kvq_ctx_opts none;
    return t_current ? *t_current : none;
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
