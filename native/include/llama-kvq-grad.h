// pykvq: the attention graph's side of runtime gradients (native/llama/llama-kvq-grad.cpp; the attention graph seam,
// llm_graph_context::build_attn_mha without flash attention, training graphs only)
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

// A gradient run with an exact window (llama_kvq_grad_set_window): the reads the runtime makes from the window's
// f16 rows pass no gradient to K and V, as convert/calib.py's transformers pass does (its _window_attention): the
// Fisher then weighs each cached value by what the window leaves of its error. kq = k·q of the batch itself
// ([n_kv, n_tokens, heads, streams], a training graph: cell i holds position i). Returns kq with the exact reads taken
// through a copy of k that the backward pass does not see, and sets *exact (1 on those reads) for
// llama_kvq_grad_detach_kqv; returns kq unchanged and *exact = nullptr when (cb, ud) is no gradient run with a window.
ggml_tensor * llama_kvq_grad_detach_kq(ggml_context * ctx, ggml_backend_sched_eval_callback cb, void * ud,
                                       ggml_tensor * k, ggml_tensor * q, ggml_tensor * kq, ggml_tensor ** exact);
// softmax(kq)·v with the exact reads through a copy of v the backward pass does not see (v: [n_kv, head_dim, ...])
ggml_tensor * llama_kvq_grad_detach_kqv(ggml_context * ctx, ggml_tensor * v, ggml_tensor * kq, ggml_tensor * exact);
