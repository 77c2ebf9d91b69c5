// pykvq: the llama side of pykvq's caches in llama_kv_cache and the memories that hold it: every attention
// KV cache of a memory (the cache-kind visitor), per-layer descriptions, codebooks, the online rotation
// setting, the pre-RoPE key domain, and the log line that says what a context's caches hold.
// The cache's pykvq state is a llama_kvq_cache (llama-kvq-cache.h), its functions' bodies here and in llama-kvq-window.cpp.
#include "llama-kvq-cache.h"
#include "llama-kvq-keys.h"
#include "llama-kvq-memory.h"
#include "llama-kvq-model.h"

#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-hybrid-iswa.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>

//
// the cache-kind visitor
//

int llama_kvq_for_each_kv_cache(llama_memory_i * mem, const std::function<void(llama_kv_cache &)> & f) {
    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        f(*kv);
        return 1;
    }
    if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        f(*iswa->get_base());
        f(*iswa->get_swa());
        return 2;
    }
    if (auto * hyb = dynamic_cast<llama_memory_hybrid *>(mem)) {
        f(*hyb->get_mem_attn());
        return 1;
    }
    if (auto * hyb_iswa = dynamic_cast<llama_memory_hybrid_iswa *>(mem)) {
        f(*hyb_iswa->get_mem_attn()->get_base());
        f(*hyb_iswa->get_mem_attn()->get_swa());
        return 2;
    }
    return 0;
}

//
// cells in use (llama_kvq_memory_used_cells: the soak test's leak check)
//

// the used cells of one cache: a stream's own count for seq_id < 0, else a scan for the cells holding seq_id
static int32_t kvq_used_cells(const llama_kv_cache & kv, llama_seq_id seq_id) {
    const uint32_t n_seq = kv.get_n_seq_max();
    if (seq_id >= 0) {
        const llama_kv_cells & cells = kv.get_cells(seq_id);
        int32_t n = 0;
        for (uint32_t i = 0; i < cells.size(); ++i) {
            n += !cells.is_empty(i) && cells.seq_has(i, seq_id);
        }
        return n;
    }
    // a unified cache maps every sequence to stream 0, a split one each to its own: count each stream once
    std::vector<bool> seen(kv.get_n_stream(), false);
    int32_t n = 0;
    for (uint32_t s = 0; s < n_seq; ++s) {
        const uint32_t strm = kv.get_stream(s);
        if (strm < seen.size() && !seen[strm]) {
            seen[strm] = true;
            n += (int32_t) kv.get_cells(s).get_used();
        }
    }
    return n;
}

int32_t llama_memory_kvq_used_cells(llama_memory_i * mem, llama_seq_id seq_id) {
    int32_t n = 0;
    bool out_of_range = false;
    const int n_caches = llama_kvq_for_each_kv_cache(mem, [&](llama_kv_cache & kv) {
        if (seq_id >= 0 && (uint32_t) seq_id >= kv.get_n_seq_max()) {
            out_of_range = true;
            return;
        }
        n += kvq_used_cells(kv, seq_id);
    });
    return n_caches == 0 || out_of_range ? -1 : n;
}

//
// online Hadamard rotation
//

void llama_kvq_cache::set_attn_rot(llama_attn_rot_type rot_k, llama_attn_rot_type rot_v) {
    const auto apply = [](bool & cur, llama_attn_rot_type want, int64_t n_embd_head, const char * which) {
        if (want == LLAMA_ATTN_ROT_TYPE_AUTO) {
            return;
        }
        const bool on = want == LLAMA_ATTN_ROT_TYPE_ENABLED;
        if (on && (n_embd_head <= 0 || n_embd_head % 64 != 0)) {
            LLAMA_LOG_WARN("%s: cannot rotate %s: head size %d is not a multiple of 64; rotation stays off\n",
                    __func__, which, (int) n_embd_head);
            cur = false;
            return;
        }
        cur = on;
    };
    apply(kv.attn_rot_k, rot_k, kv.n_embd_head_k_all, "K");
    apply(kv.attn_rot_v, rot_v, kv.n_embd_head_v_all, "V");

    LLAMA_LOG_INFO("%s: attn_rot_k = %d, attn_rot_v = %d (set per context)\n", __func__, kv.attn_rot_k, kv.attn_rot_v);

    kv.init_attn_rot_hadamard();
}

void llama_memory_set_attn_rot(llama_memory_i * mem, llama_attn_rot_type rot_k, llama_attn_rot_type rot_v) {
    if (llama_kvq_for_each_kv_cache(mem, [&](llama_kv_cache & kv) { llama_kvq_cache::of(kv).set_attn_rot(rot_k, rot_v); }) == 0) {
        LLAMA_LOG_WARN("%s: this memory holds no attention KV cache; the rotation setting is ignored\n", __func__);
    }
}

//
// per-layer types and nuq codebooks
//

llama_kvq_cache::llama_kvq_cache(llama_kv_cache & kv) : kv(kv), layers(kv.layers.size()) {
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const auto & l = kv.layers[ikv];
        layers[ikv].cb_k = l.k ? llama_kvq_layer_codebook(kv.model, l.il, false, l.k->type) : nullptr;
        layers[ikv].cb_v = l.v ? llama_kvq_layer_codebook(kv.model, l.il, true,  l.v->type) : nullptr;
    }
}

const int8_t * llama_kvq_cache::codebook(int32_t il, bool v) const {
    const auto it = kv.map_layer_ids.find(il);
    if (it == kv.map_layer_ids.end()) {
        return nullptr;
    }
    return v ? layers[it->second].cb_v : layers[it->second].cb_k;
}

void llama_kvq_cache::describe(std::vector<llama_kvq_layer_desc> & out) const {
    for (const auto & [il, ikv] : kv.map_layer_ids) {
        if (il < 0 || (size_t) il >= out.size()) {
            continue;
        }
        const auto & layer = kv.layers[ikv];
        const auto & kl    = layers[ikv];
        auto & d = out[il];
        d.il_owner = layer.il;
        d.rot_k = kv.attn_rot_k;
        d.rot_v = kv.attn_rot_v;
        d.k_domain = kl.k_mean ? LLAMA_KVQ_K_DOMAIN_PRE : !kl.k_centre.empty() ? LLAMA_KVQ_K_DOMAIN_CENTRED : LLAMA_KVQ_K_DOMAIN_POST;
        d.encoder = encoder;
        if (layer.k) {
            d.type_k = layer.k->type;
            d.cb_k = llama_kvq_is_nuq(layer.k->type) ? (kl.cb_k ? 1 : 2) : 0;
            d.n_embd_k_gqa = layer.k->ne[0];
            d.host_k = layer.k->buffer == nullptr || ggml_backend_buffer_is_host(layer.k->buffer);
        }
        if (layer.v) {
            d.type_v = layer.v->type;
            d.cb_v = llama_kvq_is_nuq(layer.v->type) ? (kl.cb_v ? 1 : 2) : 0;
            d.n_embd_v_gqa = layer.v->ne[0];
        }
    }
}

std::vector<llama_kvq_layer_desc> llama_memory_kvq_layers(const llama_memory_i * mem, uint32_t n_layer) {
    std::vector<llama_kvq_layer_desc> out(n_layer);
    llama_kvq_for_each_kv_cache(const_cast<llama_memory_i *>(mem), [&](llama_kv_cache & kv) { llama_kvq_cache::of(kv).describe(out); });
    return out;
}

std::string llama_kvq_cache::types_str(bool v) const {
    std::map<ggml_type, size_t> bytes; // type -> bytes over the layers of that type
    for (const auto & l : kv.layers) {
        if (const ggml_tensor * t = v ? l.v : l.k) {
            bytes[t->type] += ggml_nbytes(t);
        }
    }
    if (bytes.size() <= 1) {
        return bytes.empty() ? "none" : ggml_type_name(bytes.begin()->first);
    }
    std::string s = "mixed:";
    for (const auto & [t, n] : bytes) {
        s += format(" %s %.2f MiB", ggml_type_name(t), n / (1024.0 * 1024.0));
    }
    return s;
}

bool llama_kvq_cache::any_quantized(bool v) const {
    return std::any_of(kv.layers.begin(), kv.layers.end(), [&](const auto & l) {
        const ggml_tensor * t = v ? l.v : l.k;
        return t && ggml_is_quantized(t->type);
    });
}

// pykvq: what the context's attention caches hold, per layer: the types when they differ between layers,
// the true average bits per cached value, and where the nuq codebooks come from
void llama_kvq_check_cache_devices(const llama_model & model, const llama_memory_i * mem) {
    const auto layers = llama_memory_kvq_layers(mem, model.hparams.n_layer_all);
    for (uint32_t il = 0; il < layers.size(); ++il) {
        const ggml_type t = (ggml_type) layers[il].type_k;
        if (ggml_kvq_type_is_kvq(t) && !ggml_kvq_type_has_cuda(t) && !layers[il].host_k) {
            throw std::runtime_error(format("layer %u: the %s K cache has CPU kernels only, and this context puts it on "
                    "a device: keep the KV cache on the CPU (-nkvo / offload_kqv = false), or use another K cache type", il,
                    ggml_type_name(t)));
        }
    }
}

void llama_kvq_log_cache(const llama_model & model, const llama_memory_i * mem) {
    const auto layers = llama_memory_kvq_layers(mem, model.hparams.n_layer_all);

    double bits[2] = { 0, 0 }, values[2] = { 0, 0 };
    for (int v = 0; v < 2; ++v) {
        std::map<int32_t, std::vector<uint32_t>> by_type; // type -> layers
        int n_file = 0, n_fallback = 0;
        bool rot = false;
        for (uint32_t il = 0; il < layers.size(); ++il) {
            const auto & d = layers[il];
            const int32_t  t = v ? d.type_v : d.type_k;
            const uint32_t n = v ? d.n_embd_v_gqa : d.n_embd_k_gqa;
            if (t < 0 || d.il_owner != (int32_t) il) {
                continue; // no cache, or another layer's (counted there)
            }
            by_type[t].push_back(il);
            bits[v]   += 8.0 * ggml_row_size((ggml_type) t, n);
            values[v] += n;
            const int32_t src = v ? d.cb_v : d.cb_k;
            n_file     += src == 1;
            n_fallback += src == 2;
            rot = rot || (v ? d.rot_v : d.rot_k);
        }
        const char which = v ? 'V' : 'K';
        if (by_type.size() > 1) {
            // most common type first, the others with their layers
            std::vector<std::pair<int32_t, std::vector<uint32_t>>> sorted(by_type.begin(), by_type.end());
            std::stable_sort(sorted.begin(), sorted.end(), [](const auto & a, const auto & b) { return a.second.size() > b.second.size(); });
            std::string s;
            for (size_t i = 0; i < sorted.size(); ++i) {
                s += format("%s%s \u00d7%zu", i ? ", " : "", ggml_type_name((ggml_type) sorted[i].first), sorted[i].second.size());
                if (i > 0) {
                    s += " (layer" + std::string(sorted[i].second.size() > 1 ? "s " : " ");
                    for (size_t j = 0; j < sorted[i].second.size(); ++j) {
                        s += format("%s%u", j ? "," : "", sorted[i].second[j]);
                    }
                    s += ")";
                }
            }
            LLAMA_LOG_INFO("%s: %c cache types per layer: %s\n", __func__, which, s.c_str());
        }
        if (n_file + n_fallback > 0) {
            LLAMA_LOG_INFO("%s: %c codebooks: file for %d layers, fallback for %d\n", __func__, which, n_file, n_fallback);
            const int cal_rot = model.kvq.codebook_rot[v];
            if (n_file > 0 && cal_rot >= 0 && (cal_rot == 1) != rot) {
                LLAMA_LOG_WARN("%s: the GGUF's %c codebooks were calibrated with the online Hadamard rotation %s, but this context has it %s "
                        "(pykvq.cache.codebook_rot_%c); expect a worse %c cache\n", __func__, which, cal_rot ? "on" : "off", rot ? "on" : "off",
                        v ? 'v' : 'k', which);
            }
        }
    }
    if (values[0] + values[1] > 0) {
        LLAMA_LOG_INFO("%s: KV cache bits/value: K %.3f, V %.3f, K+V %.3f\n", __func__,
                values[0] > 0 ? bits[0] / values[0] : 0.0, values[1] > 0 ? bits[1] / values[1] : 0.0,
                (bits[0] + bits[1]) / (values[0] + values[1]));
    }
}

//
// the pre-RoPE key cache (the graph side: native/llama/llama-kvq-prerope.cpp)
//

// why layer il cannot cache its keys centred by the file's statistics (pre-RoPE, or centred post-RoPE without
// the scale), nullptr when it can
static const char * kvq_centring_unsupported(const llama_model & model, uint32_t il, bool need_scale) {
    const auto & hp = model.hparams;
    const auto & ml = model.layers[il];
    const char * why = llama_kvq_prerope_unsupported(llama_model_rope_type(&model), hp.has_rope(il), hp.n_lora_kv > 0);
    if (why == nullptr && (ml.kvq_k_mean == nullptr || (need_scale && ml.kvq_k_scale == nullptr))) {
        why = need_scale ? "the file lacks blk.N.kvq_k_mean / kvq_k_scale" : "the file lacks blk.N.kvq_k_mean";
    }
    return why;
}

// the encoder of the cache's q4_0 / q5_0 writes: least-squares block scales (ggml_kvq_lsq_block) for a pykvq-converted
// file, the stock one otherwise, so that a stock GGUF's cache stays exactly upstream's; the encoder setting overrides
static int kvq_pick_encoder(const llama_model & model, const llama_kvq_ctx_opts & opts, bool logged) {
    const bool forced    = opts.encoder >= 0;
    const bool converted = model.gguf_kv.count(LLAMA_KVQ_KEY_GENERAL_VERSION) > 0;
    const bool lsq       = forced ? opts.encoder == GGML_KVQ_ENCODER_LSQ : converted;
    if (logged) {
        LLAMA_LOG_INFO("%s: q4_0 / q5_0 cache writes: %s (%s)\n", "llama_kv_cache", lsq ? "least-squares block scales" : "stock encoder",
                       forced ? "the encoder setting" : converted ? "a pykvq-converted file" : "not a pykvq-converted file");
    }
    return lsq ? GGML_KVQ_ENCODER_LSQ : GGML_KVQ_ENCODER_STOCK;
}

uint32_t llama_kvq_cache::set_k_domain(const llama_kvq_ctx_opts & opts) {
    n_prerope = 0;
    n_centred = 0;
    const auto & model = kv.model;
    // logged where it matters: some layer's K or V is q4_0 / q5_0
    const auto searched = [](const ggml_tensor * t) { return t != nullptr && (t->type == GGML_TYPE_Q4_0 || t->type == GGML_TYPE_Q5_0); };
    encoder = kvq_pick_encoder(model, opts, std::any_of(kv.layers.begin(), kv.layers.end(),
                                                            [&](const auto & l) { return searched(l.k) || searched(l.v); }));
    // auto: quantized K layers; post: none; pre: every layer, an f16 K cache too (for equivalence tests);
    // centred: quantized K layers cached after RoPE, minus the file's mean rotated with them
    const bool force_post = opts.k_domain == LLAMA_KVQ_K_DOMAIN_POST;
    const bool force_pre  = opts.k_domain == LLAMA_KVQ_K_DOMAIN_PRE;
    const bool centred    = opts.k_domain == LLAMA_KVQ_K_DOMAIN_CENTRED;
    if (!model.kvq.k_prerope || kv.other) {
        return 0;
    }
    if (force_post) {
        LLAMA_LOG_INFO("%s: pre-RoPE key cache off (k_domain = post): keys are cached after RoPE\n", __func__);
        return 0;
    }
    if (centred) {
        return set_centred(opts);
    }
    const char * why_not = nullptr;
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const uint32_t il = kv.layers[ikv].il;
        const auto & ml = model.layers[il];
        // an unquantized K cache gains nothing from centring: it stays exactly upstream's
        if (!ggml_is_quantized(kv.layers[ikv].k->type) && !force_pre) {
            continue;
        }
        const char * why = kvq_centring_unsupported(model, il, true);
        // CUDA-held layers read pre-RoPE keys too: GPU = CPU at every batch size, with and without CUDA graphs
        // (H200, 2026-11-28, docs/RESULTS-BY-DATE.md); the post-RoPE fallback of 2026-11-27 is gone
        if (why != nullptr) {
            why_not = why;
            LLAMA_LOG_WARN("%s: layer %u keeps a post-RoPE K cache: %s\n", __func__, il, why);
            continue;
        }
        layers[ikv].k_mean  = ml.kvq_k_mean;     // their values were checked when the model loaded (llama_kvq_load_codebooks)
        layers[ikv].k_scale = ml.kvq_k_scale;
        layers[ikv].q_mean  = ml.kvq_q_mean;
        ++n_prerope;
    }
    // keys of a halves type (q53_64, q42_64) are turned within each half only (llama_kvq_new_k_rot)
    const bool halves = llama_kvq_halves_k(kv.layers);
    LLAMA_LOG_INFO("%s: pre-RoPE key cache in %u of %zu layers (centred by the file's kvq_k_mean / kvq_k_scale, RoPE applied "
                   "when flash attention reads K; online Hadamard of the centred K %s)%s%s\n", __func__, n_prerope, layers.size(),
                   !kv.attn_rot_k ? "off" : halves ? "on, within each half of the blocks" : "on",
                   why_not ? "; others post-RoPE: " : "", why_not ? why_not : "");
    return n_prerope;
}

// a model tensor's values; zeros for a model loaded without its weights (the tools' -fit probe only sizes graphs)
static void kvq_tensor_values(const ggml_tensor * t, std::vector<float> & out) {
    out.assign(ggml_nelements(t), 0.0f);
    if (t->data != nullptr && t->buffer != nullptr) {
        ggml_backend_tensor_get(t, out.data(), 0, ggml_nbytes(t));
    }
}

uint32_t llama_kvq_cache::set_centred(const llama_kvq_ctx_opts & opts) {
    const auto & model = kv.model;
    const bool neox = llama_model_rope_type(&model) == LLAMA_ROPE_TYPE_NEOX;
    // the mean pairs kept are chosen by the keys' variance: the file's kvq_k_std, or its scales where they
    // are the std (method std; convert/prerope.py)
    char method[32] = "";
    llama_model_meta_val_str(&model, LLAMA_KVQ_KEY_CACHE_K_SCALE_METHOD, method, sizeof(method));
    const bool std_scale = strcmp(method, "std") == 0;
    bool have_std = true;
    int kept = 0, all = 0;
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const uint32_t il = kv.layers[ikv].il;
        auto & layer = layers[ikv];
        const auto & ml = model.layers[il];
        if (!ggml_is_quantized(kv.layers[ikv].k->type)) {
            continue;
        }
        const char * why = kvq_centring_unsupported(model, il, false);
        if (why != nullptr) {
            LLAMA_LOG_WARN("%s: layer %u keeps a plain post-RoPE K cache: %s\n", __func__, il, why);
            continue;
        }
        const int64_t DK = ml.kvq_k_mean->ne[0], n_head_kv = ml.kvq_k_mean->ne[1];
        kvq_tensor_values(ml.kvq_k_mean, layer.k_centre);
        std::vector<float> var;
        const ggml_tensor * sd = ml.kvq_k_std != nullptr ? ml.kvq_k_std : std_scale ? ml.kvq_k_scale : nullptr;
        have_std = have_std && sd != nullptr;
        if (sd != nullptr) {
            kvq_tensor_values(sd, var);
            for (float & x : var) {
                x *= x;
            }
        }
        kept += llama_kvq_centre_pairs(layer.k_centre, var, DK, n_head_kv, (int) kv.hparams.n_rot(il), neox, opts.centre_residual);
        all  += (int) (n_head_kv*kv.hparams.n_rot(il)/2);
        ++n_centred;
    }
    LLAMA_LOG_INFO("%s: centred post-RoPE key cache in %u of %zu layers (k_domain = centred: keys minus the file's "
                   "kvq_k_mean rotated with them, %d of %d mean pairs kept%s; online Hadamard %s)\n", __func__, n_centred,
                   layers.size(), kept, all, have_std ? "" : " (no std in the file: every pair)", kv.attn_rot_k ? "on" : "off");
    return n_centred;
}

const std::vector<float> * llama_kvq_cache::centred(int32_t il) const {
    const auto & layer = at(il);
    return layer.k_centre.empty() ? nullptr : &layer.k_centre;
}

std::pair<ggml_tensor *, ggml_tensor *> llama_kvq_cache::prerope(int32_t il) const {
    const auto & layer = at(il);
    return { layer.k_mean, layer.k_scale };
}

ggml_tensor * llama_kvq_cache::build_input_k_pos(const llama_kv_cache_context * mctx, ggml_context * ctx) {
    const llama_kvq_cache & c = of(mctx);
    if (c.n_prerope == 0 && c.n_centred == 0) {
        return nullptr;
    }
    // with an exact window, planes 1-3 give each cell's window row, its last reader and the queries' positions
    // (ggml_kvq_fa_set_window; a batch's tokens are cells of the view, so n_kv >= the queries of a stream)
    const slot_info & sinfo = mctx->sinfos[mctx->i_cur];
    ggml_tensor * pos = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, mctx->n_kv, sinfo.s1 - sinfo.s0 + 1, c.win ? 4 : 1);
    ggml_set_name(pos, "kvq_k_pos");
    ggml_set_input(pos);
    if (c.win) {
        llama_kvq_window_layer_pos(*c.win, ctx, pos);
    }
    return pos;
}

void llama_kvq_cache::set_input_k_pos(const llama_kv_cache_context * mctx, ggml_tensor * dst) {
    // The positions are FA's src[5], a graph leaf (llama_kvq_fa_inputs_to_graph): a host input the scheduler copies
    // to the node's backend; written with ggml_backend_tensor_set, which serves any buffer.
    const llama_kvq_cache & c = of(mctx);
    const slot_info & sinfo = mctx->sinfos[mctx->i_cur];
    const int64_t n_kv = dst->ne[0];
    std::vector<int32_t> data(ggml_nelements(dst));
    for (int64_t s = 0; s < dst->ne[1]; ++s) {
        const auto & cells = c.kv.v_cells[sinfo.s0 + s];
        for (int64_t j = 0; j < n_kv; ++j) {
            const bool used = j < (int64_t) cells.size() && !cells.is_empty(j);
            data[s*n_kv + j] = used ? cells.pos_get(j) : 0;
            if (dst->ne[2] > 1) {   // planes 1-3: the exact window
                int32_t row, last, qpos;
                llama_kvq_window_planes(*c.win, sinfo.s0 + s, j, &row, &last, &qpos);
                data[(1*dst->ne[1] + s)*n_kv + j] = used ? row : -1;
                if (dst->ne[2] > 3) {
                    data[(2*dst->ne[1] + s)*n_kv + j] = last;
                    data[(3*dst->ne[1] + s)*n_kv + j] = qpos;
                }
            }
        }
    }
    ggml_backend_tensor_set(dst, data.data(), 0, ggml_nbytes(dst));
    if (c.win) {
        llama_kvq_window_set_layer_pos(*c.win, c.kv.v_cells, sinfo.s0, n_kv, data);
    }
}

uint32_t llama_memory_kvq_set_k_domain(llama_memory_i * mem, const llama_kvq_ctx_opts & opts, uint32_t n_ubatch) {
    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        auto & c = llama_kvq_cache::of(*kv);
        const uint32_t n = c.set_k_domain(opts);
        c.set_window(std::max(opts.kv_window, 0), std::max(opts.kv_sinks, 0), n_ubatch,
                     opts.kv_window_type == GGML_TYPE_Q8_0 ? GGML_TYPE_Q8_0 : GGML_TYPE_F16, std::max(opts.kv_heavy, 0.0));
        return n;
    }
    // sliding-window models (gemma3, ...): the base and the SWA cache each hold their own layers, and
    // build_attn's iSWA overload reads both (the attention graph seam). Hybrid memories build attention elsewhere: not yet.
    if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        return llama_kvq_cache::of(*iswa->get_base()).set_k_domain(opts) + llama_kvq_cache::of(*iswa->get_swa()).set_k_domain(opts);
    }
    return 0;
}

//
// cache writes
//

ggml_tensor * llama_kvq_cache::cpy_k(ggml_tensor * set_rows, const ggml_tensor * k_cur, int32_t il) const {
    const auto & layer = at(il);
    // a pre-RoPE layer is written by llm_graph_context::build_attn, which centres k before RoPE;
    // any other caller would store post-RoPE keys that attention then rotates again
    if (layer.k_mean != nullptr && (k_cur->op == GGML_OP_ROPE || (k_cur->src[0] && k_cur->src[0]->op == GGML_OP_ROPE))) {
        throw std::runtime_error(format("layer %d: a pre-RoPE K cache written with post-RoPE keys (an attention path pykvq does not hook); "
                                        "use --kv-domain post", il));
    }
    return llama_kvq_set_encoder(llama_kvq_set_codebook(set_rows, set_rows->type, layer.cb_k), encoder);
}

ggml_tensor * llama_kvq_cache::cpy_v(ggml_tensor * set_rows, int32_t il) const {
    return llama_kvq_set_encoder(llama_kvq_set_codebook(set_rows, set_rows->type, at(il).cb_v), encoder);
}

//
// session states: what decodes a layer's bytes, in its type word
//

int32_t llama_kvq_cache::state_word(int32_t il, bool v) const {
    const size_t ikv = kv.map_layer_ids.at(il);
    const auto & layer = layers[ikv];
    if (v) {
        return llama_kvq_state_type_word(kv.layers[ikv].v->type, layer.cb_v, 0, kv.attn_rot_v);
    }
    return llama_kvq_state_type_word(kv.layers[ikv].k->type, layer.cb_k, layer.k_mean ? 1 : layer.k_centre.empty() ? 0 : 2,
                                     kv.attn_rot_k);
}

int32_t llama_kvq_state_type_word(ggml_type type, const int8_t * cb, int k_domain, bool rot) {
    int32_t word = (int32_t) type | (k_domain == 1 ? LLAMA_KVQ_STATE_PREROPE : 0) | (k_domain == 2 ? LLAMA_KVQ_STATE_CENTRED : 0) |
                   (rot ? LLAMA_KVQ_STATE_ROT : 0);
    if (cb != nullptr && llama_kvq_is_nuq(type)) {
        uint32_t h = 2166136261u; // FNV-1a over the codebook's entries
        for (int i = 0; i < llama_kvq_n_codes(type); ++i) {
            h = (h ^ (uint8_t) cb[i]) * 16777619u;
        }
        word |= (int32_t) (1 + h % 255) << LLAMA_KVQ_STATE_CB_SHIFT;
    }
    return word;
}

std::string llama_kvq_state_mismatch(int32_t have, int32_t want, char which) {
    if (have == want) {
        return "";
    }
    const int32_t type_mask = LLAMA_KVQ_STATE_PREROPE - 1;
    const auto type_name = [&](int32_t w) { return std::string(ggml_type_name((ggml_type) (w & type_mask))); };
    if ((have & type_mask) != (want & type_mask)) {
        return format("mismatched %s type (the state holds %s, this context's cache is %s)", which == 'K' ? "key" : "value",
                      type_name(have).c_str(), type_name(want).c_str());
    }
    if ((have ^ want) & LLAMA_KVQ_STATE_ROT) {
        return format("the state's %c cache was written with the online Hadamard rotation %s, this context has it %s "
                      "(-rot%c / attn_rot_%c)", which, (have & LLAMA_KVQ_STATE_ROT) ? "on" : "off",
                      (want & LLAMA_KVQ_STATE_ROT) ? "on" : "off", which == 'K' ? 'k' : 'v', which == 'K' ? 'k' : 'v');
    }
    if ((have ^ want) & (LLAMA_KVQ_STATE_PREROPE | LLAMA_KVQ_STATE_CENTRED)) {
        const auto domain = [](int32_t w) {
            return (w & LLAMA_KVQ_STATE_PREROPE) ? "pre-RoPE" : (w & LLAMA_KVQ_STATE_CENTRED) ? "centred post-RoPE" : "post-RoPE";
        };
        return format("the state holds a %s K cache, this context's is %s (pykvq key domain)", domain(have), domain(want));
    }
    const int cb_have = (have >> LLAMA_KVQ_STATE_CB_SHIFT) & 0xff, cb_want = (want >> LLAMA_KVQ_STATE_CB_SHIFT) & 0xff;
    const auto cb_name = [](int f) { return f ? format("a file codebook (fingerprint %d)", f) : std::string("the fallback codebook"); };
    return format("the state's %c cache (%s) was written with %s, this context uses %s", which, type_name(have).c_str(),
                  cb_name(cb_have).c_str(), cb_name(cb_want).c_str());
}

//
// the llama_context constructor's hooks
//

void llama_kvq_init_memory(const llama_model & model, llama_memory_i * mem, const llama_kvq_ctx_opts * opts_in, bool offload_kqv,
                           uint32_t n_ubatch) {
    if (mem == nullptr) {
        return;
    }
    const llama_kvq_ctx_opts opts = opts_in ? *opts_in : llama_kvq_ctx_opts{};
    if (opts.attn_rot_k != LLAMA_ATTN_ROT_TYPE_AUTO || opts.attn_rot_v != LLAMA_ATTN_ROT_TYPE_AUTO) {
        llama_memory_set_attn_rot(mem, opts.attn_rot_k, opts.attn_rot_v);
    }
    // the cache writes' encoder, and a pre-RoPE key cache where the file asks for one and this memory can hold it
    const uint32_t n_pre = llama_memory_kvq_set_k_domain(mem, opts, n_ubatch);
    if (n_pre == 0 && model.kvq.k_prerope && !dynamic_cast<llama_kv_cache *>(mem)) {
        LLAMA_LOG_WARN("%s: the file asks for a pre-RoPE key cache, which pykvq supports in plain and sliding-window KV caches only "
                       "(not hybrid memory): keys are cached after RoPE\n", __func__);
    }
    if (n_pre > 0 && model.n_gpu_layers() > 0 && offload_kqv) {
        for (const auto & d : model.devices) {   // CUDA and pykvq RPC workers have the kernels; others are refused
            const std::string why = llama_kvq_prerope_device_unsupported(d.dev, opts.k_domain == LLAMA_KVQ_K_DOMAIN_CENTRED);
            if (!why.empty()) {
                throw std::runtime_error(why);
            }
        }
    }
    llama_kvq_check_cache_devices(model, mem);   // types with CPU kernels only
    llama_kvq_log_cache(model, mem);
}

void llama_kvq_check_without_flash_attn(const llama_model & model, const llama_memory_i * mem, bool offload_kqv) {
    const auto layers = llama_memory_kvq_layers(mem, model.hparams.n_layer_all);
    // per layer (the cache types can differ between layers)
    for (const auto & d : layers) {
        if (d.type_v >= 0 && ggml_is_quantized((ggml_type) d.type_v)) {
            throw std::runtime_error("quantized V cache was requested, but this requires Flash Attention");
        }
    }
    // without flash attention K·Q is a MUL_MAT on the cache, which no GPU backend implements for the pykvq
    // types: it would run on the CPU, copying the cache each step
    bool gpu = false;
    for (const auto & dev : model.devices) {
        gpu |= ggml_backend_dev_type(dev.dev) != GGML_BACKEND_DEVICE_TYPE_CPU;
    }
    if (gpu && offload_kqv && model.n_gpu_layers() > 0) {
        for (const auto & d : layers) {
            if (d.type_k >= 0 && ggml_kvq_type_is_kvq((ggml_type) d.type_k)) {
                throw std::runtime_error(std::string("K cache type ") + ggml_type_name((ggml_type) d.type_k) +
                                         " on a GPU needs flash attention (its K·Q has no GPU kernel without it); use -fa on");
            }
        }
    }
}
