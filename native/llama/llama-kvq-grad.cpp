// Runtime gradients (pykvq.gradients; the converter's --sensitivity gradients): per layer and token, the gradient of
// the next-token loss w.r.t. pre-RoPE K and V, from llama.cpp's own training graph (llama_opt_init, llama_opt_epoch) on
// the GGUF's quantized weights. Their squares are the diagonal Fisher that codebooks and --kv-bits budgets weigh
// cache errors with; transformers' backward pass (convert/calib.py) needs an f32 copy of the model for the same.
//
// One F32 tensor of layer 0 (its attention norm's weight) is the only trainable parameter: ggml's backward graph then
// carries gradients to everything downstream of it, every layer's K and V among them, and to no weight matrix. The
// optimizer step cannot be skipped (SGD with a learning rate of 1e-30 here), so the parameter's values are put back
// after each pass. The eval callback reads the nodes ggml names "grad for <node>": for K the one a ROPE_BACK makes
// from "Kcur*-<il>" (the gradient of the K ROPE's input, what a pre-RoPE cache stores), for V any of "Vcur-<il>"
// (the projection and its reshapes hold the same values).
//
// With an exact window (llama_kvq_grad_set_window) the attention graph takes the reads the runtime makes from the
// window's f16 rows through copies of K and V that the backward pass does not see (llama_kvq_grad_detach_kq / _kqv,
// called by build_attn_mha): ggml skips I32 nodes when it builds a backward graph, so an f32 tensor viewed as I32 and
// back is the same data without a gradient. The forward values are the plain graph's up to rounding, which a quantized
// model's 8-bit activations carry on (SmolLM2, 512 tokens: the loss 3.2023 plain, 3.1989-3.2033 with windows).
//
// The context comes from llama_kvq_grad_attach'ed params: n_ctx = n_batch = n_ubatch, so attention reads the batch's
// own K and V (llama_context::opt_init) and gradients reach them; flash attention off (no backward); an f32 cache.
// The model must be loaded without mmap (the optimizer writes the parameter) and without repacked weights (OUT_PROD
// reads plain quantized rows).

#include "llama-kvq-api.h"
#include "llama-kvq-grad.h"
#include "llama-kvq-names.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-opt.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

// (named, not in the anonymous namespace: llama_kvq_grad, a public type, holds them)
struct kvq_grad_slot {
    int64_t hd = 0, nh = 0, nt = 0;
    std::vector<float> x;       // [nt, nh, hd]
};

struct llama_kvq_grad {
    std::vector<kvq_grad_slot> k, v;        // per layer, of the last pass
    ggml_tensor * param = nullptr;          // the parameter gradients flow from
    std::vector<uint8_t> param_saved;
    bool ready = false, active = false;
    int32_t n_sink = 0, n_win = 0;          // the exact window whose reads pass no gradient (0, 0: none)
    double loss = 0.0;
    ggml_opt_optimizer_params opt_pars{};
    std::string error;
};

namespace {

bool pick_param(const ggml_tensor * t, void * ud) {
    auto * g = (llama_kvq_grad *) ud;
    if (g->param == nullptr && t->type == GGML_TYPE_F32 && strcmp(t->name, "blk.0.attn_norm.weight") == 0) {
        g->param = const_cast<ggml_tensor *>(t);
        return true;
    }
    return false;
}

bool keep(llama_kvq_grad * g, std::vector<kvq_grad_slot> & slots, int il, const ggml_tensor * t, bool shape_3d) {
    if (t->type != GGML_TYPE_F32 || t->ne[3] != 1) {
        g->error = std::string(t->name) + ": an f32 tensor of up to 3 dimensions expected";
        return false;
    }
    if (t->buffer != nullptr && !ggml_backend_buffer_is_host(t->buffer)) {
        g->error = std::string(t->name) + " is not in host memory (the gradients run on the CPU)";
        return false;
    }
    if ((int) slots.size() <= il) {
        slots.resize(il + 1);
    }
    kvq_grad_slot & s = slots[il];
    if (shape_3d) {
        s.hd = t->ne[0];
        s.nh = t->ne[1];
        s.nt = t->ne[2];
    } else if (s.x.empty()) {               // [n_head * head_dim, n_tokens], until a 3-D one tells the heads
        s.hd = t->ne[0];
        s.nh = 1;
        s.nt = t->ne[1];
    }
    s.x.resize((size_t) ggml_nelements(t));
    float * dst = s.x.data();
    for (int64_t i2 = 0; i2 < t->ne[2]; ++i2) {
        for (int64_t i1 = 0; i1 < t->ne[1]; ++i1) {
            const char * row = (const char *) t->data + i2*t->nb[2] + i1*t->nb[1];
            for (int64_t i0 = 0; i0 < t->ne[0]; ++i0) {
                memcpy(dst++, row + i0*t->nb[0], sizeof(float));
            }
        }
    }
    return true;
}

// x's data as a node ggml's backward pass gives no gradient (it skips I32 nodes and what only they feed)
ggml_tensor * no_grad(ggml_context * ctx, ggml_tensor * x) {
    GGML_ASSERT(x->type == GGML_TYPE_F32);
    ggml_tensor * a = ggml_view_4d(ctx, x, x->ne[0], x->ne[1], x->ne[2], x->ne[3], x->nb[1], x->nb[2], x->nb[3], 0);
    a->type = GGML_TYPE_I32;
    ggml_tensor * b = ggml_view_4d(ctx, a, x->ne[0], x->ne[1], x->ne[2], x->ne[3], x->nb[1], x->nb[2], x->nb[3], 0);
    b->type = GGML_TYPE_F32;
    return b;
}

// 1 where query t reads key s from the window's rows: s < n_sink or t - s < n_win (convert/window_weights.py
// read_exactly), [n_kv, n_tokens] with cell s at position s and token t at position t
ggml_tensor * exact_reads(ggml_context * ctx, int64_t n_kv, int64_t n_tok, int32_t n_sink, int32_t n_win) {
    ggml_tensor * s = ggml_repeat_4d(ctx, ggml_reshape_2d(ctx, ggml_arange(ctx, 0.0f, (float) n_kv, 1.0f), n_kv, 1),
                                     n_kv, n_tok, 1, 1);
    ggml_tensor * t = ggml_repeat_4d(ctx, ggml_reshape_2d(ctx, ggml_arange(ctx, 0.0f, (float) n_tok, 1.0f), 1, n_tok),
                                     n_kv, n_tok, 1, 1);
    ggml_tensor * win  = ggml_step(ctx, ggml_scale_bias(ctx, ggml_sub(ctx, t, s), -1.0f, n_win - 0.5f));
    ggml_tensor * sink = ggml_step(ctx, ggml_scale_bias(ctx, s, -1.0f, n_sink - 0.5f));
    return ggml_sub(ctx, ggml_add(ctx, win, sink), ggml_mul(ctx, win, sink));
}

} // namespace

ggml_tensor * llama_kvq_grad_detach_kq(ggml_context * ctx, ggml_backend_sched_eval_callback cb, void * ud,
                                       ggml_tensor * k, ggml_tensor * q, ggml_tensor * kq, ggml_tensor ** exact) {
    *exact = nullptr;
    const auto * g = (const llama_kvq_grad *) ud;
    if (cb != llama_kvq_grad_eval_cb || g == nullptr || (g->n_sink == 0 && g->n_win == 0) || k->type != GGML_TYPE_F32) {
        return kq;
    }
    ggml_tensor * e = exact_reads(ctx, kq->ne[0], kq->ne[1], g->n_sink, g->n_win);
    *exact = e;
    ggml_tensor * far = ggml_mul(ctx, kq, ggml_scale_bias(ctx, e, -1.0f, 1.0f));
    return ggml_add(ctx, far, ggml_mul(ctx, ggml_mul_mat(ctx, no_grad(ctx, k), q), e));
}

ggml_tensor * llama_kvq_grad_detach_kqv(ggml_context * ctx, ggml_tensor * v, ggml_tensor * kq, ggml_tensor * exact) {
    // every read, less the exact ones through v, plus the exact ones through v's gradient-free copy
    ggml_tensor * kq_exact = ggml_mul(ctx, kq, exact);
    ggml_tensor * far = ggml_sub(ctx, ggml_mul_mat(ctx, v, kq), ggml_mul_mat(ctx, v, kq_exact));
    return ggml_add(ctx, far, ggml_mul_mat(ctx, no_grad(ctx, v), kq_exact));
}

extern "C" {

bool llama_kvq_grad_eval_cb(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * g = (llama_kvq_grad *) user_data;
    const int ik = t->op == GGML_OP_ROPE_BACK ? llama_kvq_layer_of(t->name, "grad for Kcur") : -1;
    const int iv = llama_kvq_layer_of(t->name, "grad for Vcur");
    if (ask) {
        return g->active && g->error.empty() && (ik >= 0 || iv >= 0);
    }
    if (!g->active || !g->error.empty()) {
        return true;
    }
    if (ik >= 0) {
        keep(g, g->k, ik, t, true);
    } else if (iv >= 0) {
        keep(g, g->v, iv, t, t->ne[2] > 1);
    }
    return true;
}

struct llama_kvq_grad * llama_kvq_grad_init(void) {
    return new llama_kvq_grad();
}

void llama_kvq_grad_free(struct llama_kvq_grad * g) {
    delete g;
}

void llama_kvq_grad_attach(struct llama_kvq_grad * g, struct llama_context_params * params) {
    params->cb_eval = llama_kvq_grad_eval_cb;
    params->cb_eval_user_data = g;
    params->n_batch = params->n_ubatch = params->n_ctx;
    params->type_k = params->type_v = GGML_TYPE_F32;
    params->flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
}

bool llama_kvq_grad_set_window(struct llama_kvq_grad * g, int32_t n_sink, int32_t n_win) {
    if (n_sink < 0 || n_win < 0) {
        g->error = "the exact window's sinks and cells are counts >= 0";
        return false;
    }
    if (g->ready) {
        g->error = "the exact window is set before the first pass (the graph is built with it)";
        return false;
    }
    g->n_sink = n_sink;
    g->n_win = n_win;
    return true;
}

bool llama_kvq_grad_run(struct llama_kvq_grad * g, struct llama_context * ctx, const llama_token * tokens,
                        const llama_token * labels, int32_t n) {
    if (!g->error.empty()) {
        return false;
    }
    if (n < 2 || (uint32_t) n != llama_n_ctx(ctx) || llama_n_ubatch(ctx) != llama_n_ctx(ctx)) {
        g->error = "a pass takes exactly n_ctx tokens, in one ubatch (a context made with llama_kvq_grad_attach)";
        return false;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    for (int32_t i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab || labels[i] < 0 || labels[i] >= n_vocab) {
            g->error = "token id " + std::to_string(tokens[i] < 0 || tokens[i] >= n_vocab ? tokens[i] : labels[i]) +
                       " is outside the vocabulary";
            return false;
        }
    }
    if (!g->ready) {
        g->opt_pars = ggml_opt_get_default_optimizer_params(nullptr);
        g->opt_pars.sgd.alpha = 1e-30f;         // it must be > 0; the parameter is restored after each pass anyway
        g->opt_pars.sgd.wd = 0.0f;
        llama_opt_params lp = {};
        lp.n_ctx_train = 0;
        lp.param_filter = pick_param;
        lp.param_filter_ud = g;
        lp.get_opt_pars = ggml_opt_get_constant_optimizer_params;
        lp.get_opt_pars_ud = &g->opt_pars;
        lp.optimizer_type = GGML_OPT_OPTIMIZER_TYPE_SGD;
        llama_opt_init(ctx, const_cast<llama_model *>(llama_get_model(ctx)), lp);
        if (g->param == nullptr) {
            g->error = "the model has no f32 tensor blk.0.attn_norm.weight to take gradients from";
            return false;
        }
        g->param_saved.resize(ggml_nbytes(g->param));
        ggml_backend_tensor_get(g->param, g->param_saved.data(), 0, g->param_saved.size());
        // opt_init made a new scheduler; the eval callback reaches it with the next graph a decode builds
        llama_batch b = llama_batch_get_one(const_cast<llama_token *>(tokens), n);
        if (llama_decode(ctx, b) != 0) {
            g->error = "the first decode of the training context failed";
            return false;
        }
        g->ready = true;
    }
    ggml_opt_dataset_t ds = ggml_opt_dataset_init(GGML_TYPE_I32, GGML_TYPE_I32, n, n, 1, 1);
    memcpy(ggml_opt_dataset_data(ds)->data, tokens, sizeof(llama_token) * n);
    memcpy(ggml_opt_dataset_labels(ds)->data, labels, sizeof(llama_token) * n);
    ggml_opt_result_t train = ggml_opt_result_init(), eval = ggml_opt_result_init();
    g->k.clear();
    g->v.clear();
    g->active = true;
    llama_opt_epoch(ctx, ds, train, eval, /*idata_split =*/ 1, nullptr, nullptr);
    g->active = false;
    double unc = 0.0;
    ggml_opt_result_loss(train, &g->loss, &unc);
    ggml_opt_result_free(train);
    ggml_opt_result_free(eval);
    ggml_opt_dataset_free(ds);
    ggml_backend_tensor_set(g->param, g->param_saved.data(), 0, g->param_saved.size());
    if (g->error.empty() && g->k.empty()) {
        g->error = "no K gradient reached a ROPE_BACK node named after Kcur-N: this architecture's attention is not "
                   "one the runtime gradients can read";
    }
    return g->error.empty();
}

double llama_kvq_grad_loss(const struct llama_kvq_grad * g) {
    return g->loss;
}

int32_t llama_kvq_grad_n_layer(const struct llama_kvq_grad * g) {
    return (int32_t) g->k.size();
}

int64_t llama_kvq_grad_get(const struct llama_kvq_grad * g, int32_t il, int32_t which, int64_t * head_dim,
                           int64_t * n_head, float * dst, int64_t capacity) {
    const auto & slots = which == 1 ? g->k : g->v;
    if ((which != 1 && which != 2) || il < 0 || il >= (int32_t) slots.size() || slots[il].x.empty()) {
        return -1;
    }
    const kvq_grad_slot & s = slots[il];
    *head_dim = s.hd;
    *n_head = s.nh;
    const int64_t n = (int64_t) s.x.size();
    if (dst != nullptr) {
        memcpy(dst, s.x.data(), sizeof(float) * (size_t) std::min(n, capacity));
    }
    return n;
}

const char * llama_kvq_grad_error(const struct llama_kvq_grad * g) {
    return g->error.c_str();
}

} // extern "C"
