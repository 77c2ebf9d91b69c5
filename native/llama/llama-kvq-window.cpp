// pykvq: the exact window of a pre-RoPE key cache. Per layer and stream, n_sink + n_win rows hold unquantized (f16,
// or q8_0 where the CPU or CUDA attends: half the bytes, and 8-bit rows cost nothing measurable against f16 ones) copies of
// what the cache stores for its first positions (attention sinks: position < n_sink) and for the cells
// written last (a ring of n_win rows). Every cell is quantized into the cache as usual when written; flash attention
// reads a cell's exact row instead while the row is still its own (ggml_kvq_fa_set_window), so a cell "enters" the
// quantized cache when the ring moves past it. Pre-RoPE rows do not depend on positions: a K-shift moves nothing.
//
// The window is per query: a query at position p reads exact rows for the cells at positions p - n_win + 1 .. p (and
// the sinks), in decode and in a prefill batch alike, so a prompt's tokens see what decoding them one by one would.
// A batch first writes all its rows to stage rows after the slots (one per token of a ubatch), attention reads them
// with the ring as it was, and then the batch's last n_win per sequence move into the ring (ordered after the
// layer's attention in the graph). A stream shared by several sequences (kv_unified) has sinks and a ring per
// sequence (a token shared by several: its first sequence). What holds a row is host bookkeeping, updated when a
// batch's inputs are set. A state carries its cells' rows (see "states" below); a stream copy copies them.
//
// Heavy hitters (kv_heavy, a fraction of each sequence's context): n_heavy more slots per sequence and layer keep
// the cells whose keys score highest against the file's mean query (blk.N.kvq_q_mean: Q̄·k, the key's mean score
// before RoPE) exact for every later query, as sinks are. A batch's graph writes each token's score beside its stage
// row; the next batch's inputs read them and choose per layer (a free slot, else the lowest-scoring member's if the
// token scores higher: a member that loses its slot is quantized for good), and its graph copies the chosen stage
// rows into their slots before it writes its own. Each such layer's attention reads its own positions input (the
// shared one's 4 planes, its members' rows patched into planes 1-2). A cell written again, or empty, leaves the store;
// states do not carry it.
#include "llama-kvq-cache.h"

#include "llama-batch.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-kv-cache.h"

#include "ggml-cpp.h"
#include "ggml-kvq-rpc.h"

#include <algorithm>
#include <cstring>

struct llama_kvq_window {
    uint32_t n_win  = 0;
    uint32_t n_sink = 0;
    uint32_t n_seq  = 1;                 // sequences per stream (n_seq_max of a unified cache, else 1)
    uint32_t n_slot = 0;                 // per_seq() per sequence + 1: the last takes what a batch writes past a ring
    uint32_t n_stage = 0;                // rows after every stream's slots: one per token of a ubatch (n_ubatch)
    std::vector<ggml_tensor *> rows;     // per cache layer: F16 / Q8_0 [n_embd_k_gqa + n_embd_v_gqa, n_slot*n_stream + n_stage]
    std::vector<ggml_context_ptr> ctxs;
    std::vector<ggml_backend_buffer_ptr> bufs;
    // per stream: the cell whose row each slot holds, the slot of each cell (-1: none), each sequence's ring's next slot
    mutable std::vector<std::vector<int32_t>> slot_cell;
    mutable std::vector<std::vector<int32_t>> cell_slot;
    mutable std::vector<std::vector<uint32_t>> next;
    // this batch's planes 1-3 of the positions input, per stream: each cell's row and the last query position reading
    // it (as attention sees them: the ring before the batch moves it, the batch's cells in stage rows), the queries'
    // positions
    mutable std::vector<std::vector<int32_t>> plane_row, plane_last, plane_qpos;
    // per layer, between kvq_win_write and kvq_win_attach of one graph: what moves into the ring after attention
    struct keep_write { ggml_context * ctx; ggml_cgraph * gf; ggml_tensor * k2, * v2, * idxs; };
    mutable std::vector<keep_write> keep;

    // heavy hitters (n_heavy > 0)
    uint32_t n_heavy = 0;                // slots per sequence, after its ring
    uint32_t n_copy  = 0;                // rows a graph may copy into them per layer: min(n_stage, every heavy slot)
    std::vector<ggml_tensor *> q_mean;   // per cache layer: the file's kvq_q_mean (nullptr: no store in the layer)
    std::vector<ggml_tensor *> scores;   // per cache layer: F32 [n_stage], the last batch's score per stage row
    // per cache layer and stream, per heavy slot (n_seq*n_heavy, sequence by sequence): its cell (-1: free), score
    mutable std::vector<std::vector<std::vector<int32_t>>> heavy_cell;
    mutable std::vector<std::vector<std::vector<float>>>   heavy_score;
    // the last batch's stage rows: each token's stream, cell, sequence and position (chosen from by the next batch)
    struct staged { uint32_t strm; int32_t cell; uint32_t seq; llama_pos pos; };
    mutable std::vector<staged> last_stage;
    // this graph's positions input of each layer with a store (the shared one's planes, its members' rows patched in)
    mutable std::vector<ggml_tensor *> layer_pos;

    uint32_t per_seq() const { return n_sink + n_win + n_heavy; }
    uint32_t trash() const { return n_slot - 1; }
    // slots of sequence q of a stream: its sinks [q*per_seq(), + n_sink), then its ring of n_win, then n_heavy
    uint32_t base(uint32_t q) const { return q*per_seq(); }
    // the row of stream strm's heavy slot k (sequence k / n_heavy, its slot k % n_heavy)
    int32_t heavy_row(uint32_t strm, size_t k) const {
        return (int32_t) (strm*n_slot + base((uint32_t) (k / n_heavy)) + n_sink + n_win + k % n_heavy);
    }
    bool heavy_on(size_t ikv) const { return n_heavy > 0 && ikv < q_mean.size() && q_mean[ikv] != nullptr; }
};

uint32_t llama_kvq_cache::set_window(uint32_t n_win, uint32_t n_sink, uint32_t n_ubatch, ggml_type row_type, double heavy) {
    win.reset();
    if (n_win == 0 && n_sink == 0) {
        return 0;
    }
    if (n_prerope == 0) {
        LLAMA_LOG_WARN("%s: exact window off: it keeps pre-RoPE keys, and no layer's K cache is pre-RoPE (a --prerope-k file, "
                       "a quantized K type)\n", __func__);
        return 0;
    }
    if (kv.v_trans) {
        LLAMA_LOG_WARN("%s: exact window off: it needs flash attention\n", __func__);
        return 0;
    }
    // a window or sinks past the cache's size keep every cell (a file's key or a setting may ask for more)
    n_win  = std::min(n_win, kv.get_size());
    n_sink = std::min(n_sink, kv.get_size());
    auto w = std::make_shared<llama_kvq_window>();
    const uint32_t n_stream = (uint32_t) kv.v_cells.size();
    w->n_win  = n_win;
    w->n_sink = n_sink;
    w->n_seq  = n_stream == 1 ? kv.n_seq_max : 1;
    // heavy hitters: a fraction of each sequence's cells, in the layers whose file gives the mean query
    const uint32_t n_ctx_seq = kv.get_size() / w->n_seq;
    uint32_t n_q_mean = 0;
    for (const auto & l : layers) {
        n_q_mean += l.k_mean != nullptr && l.q_mean != nullptr;
    }
    if (heavy > 0.0 && n_q_mean == 0) {
        LLAMA_LOG_WARN("%s: heavy hitters off: the file has no blk.N.kvq_q_mean in its pre-RoPE layers (convert it again "
                       "with --prerope-k)\n", __func__);
    } else if (heavy > 0.0) {
        w->n_heavy = (uint32_t) std::min<double>(std::ceil(heavy*n_ctx_seq), n_ctx_seq);
    }
    w->n_slot = w->per_seq()*w->n_seq + 1;
    w->n_stage = std::max(n_ubatch, 1u);
    w->n_copy  = std::min(w->n_stage, w->n_heavy*w->n_seq*n_stream);
    w->rows.assign(layers.size(), nullptr);
    w->keep.assign(layers.size(), {});
    w->q_mean.assign(layers.size(), nullptr);
    w->scores.assign(layers.size(), nullptr);
    w->layer_pos.assign(layers.size(), nullptr);
    w->heavy_cell.assign(layers.size(), {});
    w->heavy_score.assign(layers.size(), {});
    uint32_t n_layers = 0, n_device = 0, n_q8 = 0;
    size_t bytes = 0, stage_bytes = 0, cache_bytes = 0;
    double values = 0.0;
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const auto & layer = kv.layers[ikv];
        cache_bytes += ggml_nbytes(layer.k) + ggml_nbytes(layer.v);
        values += (double) (layer.k->ne[0] + layer.v->ne[0]) * layer.k->ne[1] * layer.k->ne[2];
        // the window is read by the CPU and CUDA kernels: a device whose caps say so (an RPC worker: its HELLO)
        // (an unquantized cache has nothing to gain from one)
        if (layers[ikv].k_mean == nullptr || layer.k->buffer == nullptr || !(ggml_is_quantized(layer.k->type) || ggml_is_quantized(layer.v->type))) {
            continue;
        }
        ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(layer.k->buffer);
        if (!ggml_backend_buffer_is_host(layer.k->buffer) && !(ggml_kvq_dev_caps(ggml_backend_buft_get_device(buft)) & GGML_KVQ_RPC_WINDOW)) {
            ++n_device;
            continue;
        }
        // q8_0 rows where the kernels read them (the CPU's and CUDA's; an RPC worker's stay f16), and every head's K
        // and V start on a block (what ggml_kvq_fa_set_window asserts)
        const int64_t qk = ggml_blck_size(GGML_TYPE_Q8_0);
        const bool q8 = row_type == GGML_TYPE_Q8_0 &&
                        (ggml_backend_buffer_is_host(layer.k->buffer) || ggml_kvq_dev_window_q8(ggml_backend_buft_get_device(buft))) &&
                        kv.hparams.n_embd_head_k(layer.il) % qk == 0 && kv.hparams.n_embd_head_v(layer.il) % qk == 0;
        n_q8 += q8;
        ggml_init_params ip = { 2*ggml_tensor_overhead(), nullptr, true };
        ggml_context_ptr ctx(ggml_init(ip));
        ggml_tensor * t = ggml_new_tensor_2d(ctx.get(), q8 ? GGML_TYPE_Q8_0 : GGML_TYPE_F16, layer.k->ne[0] + layer.v->ne[0],
                                             (int64_t) w->n_slot*n_stream + w->n_stage);
        ggml_format_name(t, "kvq_window_l%u", layer.il);
        if (w->n_heavy > 0 && layers[ikv].q_mean != nullptr) {
            w->q_mean[ikv] = layers[ikv].q_mean;
            w->scores[ikv] = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_F32, w->n_stage);
            ggml_format_name(w->scores[ikv], "kvq_heavy_scores_l%u", layer.il);
            w->heavy_cell[ikv].assign(n_stream, std::vector<int32_t>((size_t) w->n_heavy*w->n_seq, -1));
            w->heavy_score[ikv].assign(n_stream, std::vector<float>((size_t) w->n_heavy*w->n_seq, 0.0f));
        }
        ggml_backend_buffer_ptr buf(ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft));
        if (!buf) {
            throw std::runtime_error(format("pykvq: cannot allocate the exact window of layer %u", layer.il));
        }
        ggml_backend_buffer_clear(buf.get(), 0);
        stage_bytes += (size_t) w->n_stage*t->nb[1] + (w->scores[ikv] ? ggml_nbytes(w->scores[ikv]) : 0);
        bytes += ggml_nbytes(t) - (size_t) w->n_stage*t->nb[1];
        w->rows[ikv] = t;
        w->ctxs.push_back(std::move(ctx));
        w->bufs.push_back(std::move(buf));
        ++n_layers;
    }
    w->slot_cell.assign(n_stream, std::vector<int32_t>(w->n_slot, -1));
    w->cell_slot.assign(n_stream, std::vector<int32_t>(kv.get_size(), -1));
    w->next.assign(n_stream, std::vector<uint32_t>(w->n_seq, 0));
    w->plane_row.assign(n_stream, {});
    w->plane_last.assign(n_stream, {});
    w->plane_qpos.assign(n_stream, {});
    if (n_layers == 0) {
        LLAMA_LOG_WARN("%s: exact window off: no quantized pre-RoPE layer is on a device whose kernels read it "
                       "(CPU, CUDA, or an RPC worker of those)\n", __func__);
        return 0;
    }
    if (n_device > 0) {
        LLAMA_LOG_WARN("%s: exact window off in %u pre-RoPE layers: their K cache is on a device without a kernel for it "
                       "(the CPU's and CUDA's read it)\n", __func__, n_device);
    }
    if (row_type == GGML_TYPE_Q8_0 && n_q8 < n_layers) {
        LLAMA_LOG_WARN("%s: exact window rows in f16 in %u layers: q8_0 rows are read by the CPU's and CUDA's kernels "
                       "(not over RPC) of heads a multiple of 32\n",
                       __func__, n_layers - n_q8);
    }
    win = w;
    char heavy_str[128] = "";
    if (w->n_heavy > 0) {
        snprintf(heavy_str, sizeof(heavy_str), " and %u heavy hitters per sequence (the keys scoring highest against the "
                 "file's mean query)", w->n_heavy);
    }
    LLAMA_LOG_INFO("%s: exact window in %u of %zu layers: the first %u positions and the last %u up to each query%s kept in %s "
                   "beside the quantized cache (%.2f MiB; K+V %.3f bits/value at %u cells with it, %.3f without; plus %.2f MiB "
                   "of stage rows for a ubatch's %u tokens)\n",
                   __func__, n_layers, layers.size(), n_sink, n_win, heavy_str,
                   n_q8 == 0 ? "f16" : n_q8 == n_layers ? "q8_0" : "f16 / q8_0",
                   bytes / (1024.0*1024.0), 8.0*(cache_bytes + bytes) / values,
                   kv.get_size(), 8.0*cache_bytes / values, stage_bytes / (1024.0*1024.0), w->n_stage);
    return n_layers;
}

std::pair<uint32_t, uint32_t> llama_kvq_cache::window_size() const {
    return win ? std::pair<uint32_t, uint32_t>{ win->n_sink, win->n_win } : std::pair<uint32_t, uint32_t>{ 0, 0 };
}

uint32_t llama_kvq_cache::heavy_size() const {
    return win ? win->n_heavy : 0;
}

const char * llama_kvq_cache::window_type() const {
    if (win) {
        for (const ggml_tensor * t : win->rows) {
            if (t != nullptr && t->type == GGML_TYPE_Q8_0) {
                return "q8_0";
            }
        }
        return "f16";
    }
    return "";
}

// a stream copy (seq_cp across streams) copies the cells: their rows and what holds them go along
void llama_kvq_cache::win_copy_stream(uint32_t ssrc, uint32_t sdst) const {
    if (!win || ssrc >= win->next.size() || sdst >= win->next.size()) {
        return;
    }
    auto & w = *win;
    w.slot_cell[sdst] = w.slot_cell[ssrc];
    w.cell_slot[sdst] = w.cell_slot[ssrc];
    w.next[sdst]      = w.next[ssrc];
    for (size_t ikv = 0; ikv < w.heavy_cell.size(); ++ikv) {
        if (w.heavy_on(ikv)) {
            w.heavy_cell[ikv][sdst]  = w.heavy_cell[ikv][ssrc];
            w.heavy_score[ikv][sdst] = w.heavy_score[ikv][ssrc];
        }
    }
    w.last_stage.clear();
    std::vector<uint8_t> buf;
    for (ggml_tensor * rows : w.rows) {
        if (rows == nullptr) {
            continue;
        }
        const size_t n = (size_t) w.n_slot*rows->nb[1];
        buf.resize(n);
        ggml_backend_tensor_get(rows, buf.data(), (size_t) ssrc*n, n);
        ggml_backend_tensor_set(rows, buf.data(), (size_t) sdst*n, n);
    }
}

ggml_tensor * llama_kvq_cache::build_input_win_idxs(ggml_context * ctx, const llama_ubatch & ubatch) const {
    if (!win) {
        return nullptr;
    }
    // each token's stage row, then its ring or sink slot (the trash slot if it keeps none); with heavy hitters, then
    // per layer n_copy rows to copy into heavy slots and n_copy slots they go to
    // (I32: GET_ROWS takes no other)
    ggml_tensor * idxs = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 2*ubatch.n_tokens + 2*(int64_t) win->n_copy*win->rows.size());
    ggml_set_input(idxs);
    ggml_set_name(idxs, "kvq_win_idxs");
    return idxs;
}

// the index of a sequence among its stream's: its id in a unified cache, else 0
static uint32_t kvq_win_seq(const llama_kvq_window & w, llama_seq_id seq) {
    return w.n_seq > 1 && seq >= 0 && (uint32_t) seq < w.n_seq ? (uint32_t) seq : 0;
}

// the last query position that reads the row of a cell at position p (a sink: every query)
static int32_t kvq_win_last(const llama_kvq_window & w, llama_pos p, bool sink) {
    if (sink) {
        return INT32_MAX;
    }
    return (int32_t) std::min<int64_t>((int64_t) p + w.n_win - 1, INT32_MAX - 1);
}

// Heavy hitters, before a batch's inputs: its cells leave every store (what they held is written over), as do empty
// ones; then each of the last batch's tokens, by the score its graph wrote, takes a free slot of its sequence in each
// layer, or the lowest-scoring member's if it scores higher. Returns per layer what this graph copies: (stage row,
// heavy slot's row).
using kvq_win_copies = std::vector<std::vector<std::pair<int32_t, int32_t>>>;
static kvq_win_copies kvq_win_choose_heavy(const llama_kvq_window & w, const std::vector<llama_kv_cells> & v_cells,
                                           const llama_kv_cache::slot_info & sinfo, int64_t stage0) {
    kvq_win_copies copies(w.rows.size());
    std::vector<std::vector<uint8_t>> fresh(v_cells.size());
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        auto & f = fresh[sinfo.strm[s]];
        f.assign(v_cells[sinfo.strm[s]].size(), 0);
        for (uint32_t i = 0; i < sinfo.size(); ++i) {
            f[sinfo.idxs[s][i]] = 1;
        }
    }
    auto gone = [&](uint32_t strm, int32_t cell) {
        return v_cells[strm].is_empty(cell) || (!fresh[strm].empty() && fresh[strm][cell]);
    };
    std::vector<float> sc;
    for (size_t ikv = 0; ikv < w.rows.size(); ++ikv) {
        if (!w.heavy_on(ikv)) {
            continue;
        }
        for (uint32_t strm = 0; strm < w.heavy_cell[ikv].size(); ++strm) {
            for (int32_t & cell : w.heavy_cell[ikv][strm]) {
                cell = cell >= 0 && gone(strm, cell) ? -1 : cell;
            }
        }
        if (w.last_stage.empty()) {
            continue;
        }
        sc.resize(w.last_stage.size());
        ggml_backend_tensor_get(w.scores[ikv], sc.data(), 0, sc.size()*sizeof(float));
        const size_t n_per_strm = (size_t) w.n_heavy*w.n_seq;
        std::vector<int64_t> from(n_per_strm*w.heavy_cell[ikv].size(), -1);  // per heavy slot: the stage row moving in
        for (size_t t = 0; t < w.last_stage.size(); ++t) {
            const auto & st = w.last_stage[t];
            if (st.cell < 0 || gone(st.strm, st.cell) || (st.pos >= 0 && (uint32_t) st.pos < w.n_sink) || !std::isfinite(sc[t])) {
                continue;
            }
            auto & hc = w.heavy_cell[ikv][st.strm];
            auto & hs = w.heavy_score[ikv][st.strm];
            const uint32_t k0 = st.seq*w.n_heavy;
            uint32_t k = k0;
            for (uint32_t j = k0; j < k0 + w.n_heavy; ++j) {
                if (hc[j] < 0) {
                    k = j;
                    break;
                }
                k = hs[j] < hs[k] ? j : k;
            }
            if (hc[k] >= 0 && !(sc[t] > hs[k])) {
                continue;
            }
            hc[k] = st.cell;
            hs[k] = sc[t];
            from[st.strm*n_per_strm + k] = stage0 + (int64_t) t;
        }
        for (size_t k = 0; k < from.size(); ++k) {
            if (from[k] >= 0) {
                copies[ikv].emplace_back((int32_t) from[k], w.heavy_row((uint32_t) (k / n_per_strm), k % n_per_strm));
            }
        }
        GGML_ASSERT(copies[ikv].size() <= w.n_copy);
    }
    w.last_stage.clear();
    return copies;
}

void llama_kvq_cache::set_input_win_idxs(const llama_kv_cache_context * mctx, ggml_tensor * dst, const llama_ubatch * ubatch) {
    const llama_kvq_cache & c = of(mctx);
    const slot_info & sinfo = mctx->sinfos[mctx->i_cur];
    const auto & v_cells = c.kv.v_cells;
    auto & w = *c.win;
    const uint32_t n = sinfo.size();
    const int64_t n_tok = ubatch->n_tokens;
    GGML_ASSERT(n_tok == (int64_t) (n*sinfo.n_stream()));
    const int64_t stage0 = (int64_t) w.n_slot*w.slot_cell.size();
    std::vector<int32_t> data(ggml_nelements(dst));
    const kvq_win_copies copies = w.n_heavy > 0 ? kvq_win_choose_heavy(w, v_cells, sinfo, stage0) : kvq_win_copies{};
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        const uint32_t strm = sinfo.strm[s];
        auto & slot_cell = w.slot_cell[strm];
        auto & cell_slot = w.cell_slot[strm];
        const auto & cells = v_cells[strm];
        // what attention reads: the rows held before this batch, then the batch's own stage rows
        auto & prow = w.plane_row[strm];
        auto & plast = w.plane_last[strm];
        prow.assign(cells.size(), -1);
        plast.assign(cells.size(), INT32_MIN);
        for (uint32_t j = 0; j < cells.size(); ++j) {
            const int32_t slot = cell_slot[j];
            if (slot >= 0 && slot_cell[slot] == (int32_t) j && !cells.is_empty(j)) {
                prow[j]  = (int32_t) (strm*w.n_slot + slot);
                plast[j] = kvq_win_last(w, cells.pos_get(j), (uint32_t) slot % w.per_seq() < w.n_sink);
            }
        }
        auto & qpos = w.plane_qpos[strm];
        qpos.resize(n);
        for (uint32_t i = 0; i < n; ++i) {
            const uint32_t cell = sinfo.idxs[s][i];
            const llama_pos p = ubatch->pos[s*n + i];
            const int64_t t = (int64_t) s*n + i;
            qpos[i] = p;
            if (t < w.n_stage) {
                prow[cell]  = (int32_t) (stage0 + t);
                plast[cell] = kvq_win_last(w, p, p >= 0 && (uint32_t) p < w.n_sink);
                data[t] = (int32_t) (stage0 + t);
            } else {
                prow[cell] = -1;
                data[t] = (int32_t) (strm*w.n_slot + w.trash());
            }
        }
        // then the ring moves: of a sequence's tokens in this batch, the last n_win take it
        std::vector<uint32_t> left(w.n_seq, 0);
        for (uint32_t i = 0; i < n; ++i) {
            left[kvq_win_seq(w, ubatch->seq_id[s*n + i][0])]++;
        }
        for (uint32_t i = 0; i < n; ++i) {
            const int32_t cell = (int32_t) sinfo.idxs[s][i];
            const llama_pos p  = ubatch->pos[s*n + i];
            const uint32_t q   = kvq_win_seq(w, ubatch->seq_id[s*n + i][0]);
            uint32_t slot = w.trash();
            if (p >= 0 && (uint32_t) p < w.n_sink) {
                slot = w.base(q) + (uint32_t) p;
            } else if (left[q] <= w.n_win && w.n_win > 0) {
                slot = w.base(q) + w.n_sink + w.next[strm][q];
                w.next[strm][q] = (w.next[strm][q] + 1) % w.n_win;
            }
            left[q]--;
            if (slot != w.trash()) {
                slot_cell[slot] = cell;
                cell_slot[cell] = (int32_t) slot;
            } else {
                cell_slot[cell] = -1;
            }
            data[n_tok + s*n + i] = (int32_t) (strm*w.n_slot + slot);
        }
    }
    if (w.n_heavy > 0) {
        // this batch's stage rows, scored by its graph; each layer's copies (the rest: trash slot to trash slot)
        w.last_stage.resize((size_t) std::min<int64_t>(n_tok, w.n_stage));
        for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
            for (uint32_t i = 0; i < n; ++i) {
                const int64_t t = (int64_t) s*n + i;
                if (t < w.n_stage) {
                    w.last_stage[t] = { (uint32_t) sinfo.strm[s], (int32_t) sinfo.idxs[s][i],
                                        kvq_win_seq(w, ubatch->seq_id[t][0]), ubatch->pos[t] };
                }
            }
        }
        for (size_t ikv = 0; ikv < w.rows.size(); ++ikv) {
            int32_t * cp = data.data() + 2*n_tok + 2*(int64_t) ikv*w.n_copy;
            std::fill(cp, cp + 2*w.n_copy, (int32_t) w.trash());
            for (size_t j = 0; j < copies[ikv].size(); ++j) {
                cp[j]            = copies[ikv][j].first;
                cp[w.n_copy + j] = copies[ikv][j].second;
            }
        }
    }
    ggml_backend_tensor_set(dst, data.data(), 0, data.size()*sizeof(int32_t));
}

// planes 1-3 of the positions input (ggml_kvq_fa_set_window) at cell j of stream strm: the row attention reads for
// it, the last query position reading that row, and query j's position (-1 / INT32_MIN / 0 where there is none)
void llama_kvq_window_planes(const llama_kvq_window & w, uint32_t strm, uint32_t j, int32_t * row, int32_t * last, int32_t * qpos) {
    const auto & prow = w.plane_row[strm];
    *row  = j < prow.size() ? prow[j] : -1;
    *last = j < prow.size() ? w.plane_last[strm][j] : INT32_MIN;
    *qpos = j < w.plane_qpos[strm].size() ? w.plane_qpos[strm][j] : 0;
}

// the node named `name` among t and its sources (a few levels up)
static ggml_tensor * kvq_find_node(ggml_tensor * t, const char * name, int depth) {
    if (t == nullptr || depth < 0) {
        return nullptr;
    }
    if (strcmp(t->name, name) == 0) {
        return t;
    }
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        if (ggml_tensor * r = kvq_find_node(t->src[i], name, depth - 1)) {
            return r;
        }
    }
    return nullptr;
}

void llama_kvq_window_layer_pos(const llama_kvq_window & w, ggml_context * ctx, const ggml_tensor * pos) {
    for (size_t ikv = 0; ikv < w.layer_pos.size(); ++ikv) {
        w.layer_pos[ikv] = nullptr;
        if (w.heavy_on(ikv)) {   // (only layers with rows have a store)
            ggml_tensor * t = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, pos->ne[0], pos->ne[1], 4);
            ggml_format_name(t, "kvq_k_pos_l%zu", ikv);
            ggml_set_input(t);
            w.layer_pos[ikv] = t;
        }
    }
}

void llama_kvq_window_set_layer_pos(const llama_kvq_window & w, const std::vector<llama_kv_cells> & v_cells, uint32_t s0,
                                    int64_t n_kv, const std::vector<int32_t> & data) {
    const int64_t n_s = (int64_t) data.size() / (4*n_kv);
    std::vector<int32_t> mine;
    for (size_t ikv = 0; ikv < w.layer_pos.size(); ++ikv) {
        ggml_tensor * t = w.layer_pos[ikv];
        if (t == nullptr || t->buffer == nullptr) {
            continue;
        }
        GGML_ASSERT(ggml_nelements(t) == (int64_t) data.size());
        mine = data;
        for (int64_t s = 0; s < n_s; ++s) {
            const uint32_t strm = s0 + (uint32_t) s;
            const auto & hc = w.heavy_cell[ikv][strm];
            for (size_t k = 0; k < hc.size(); ++k) {
                const int32_t cell = hc[k];
                if (cell >= 0 && cell < n_kv && !v_cells[strm].is_empty(cell)) {
                    mine[(1*n_s + s)*n_kv + cell] = w.heavy_row(strm, k);
                    mine[(2*n_s + s)*n_kv + cell] = INT32_MAX;   // read by every later query, as a sink
                }
            }
        }
        ggml_backend_tensor_set(t, mine.data(), 0, ggml_nbytes(t));
    }
}

void llama_kvq_cache::win_write(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * k_cur, ggml_tensor * v_cur,
                                ggml_tensor * idxs, int32_t il) const {
    const size_t ikv = kv.map_layer_ids.at(il);
    ggml_tensor * rows = win->rows[ikv];
    if (rows == nullptr) {
        return;
    }
    const int64_t n_tokens = k_cur->ne[2];
    if (win->heavy_on(ikv)) {
        // first the rows the last batch's tokens left in the stage move into their heavy slots (before this batch's
        // stage writes: nodes run in the order they were added)
        const size_t off = (2*n_tokens + 2*(int64_t) ikv*win->n_copy)*idxs->nb[0];
        ggml_tensor * from = ggml_view_1d(ctx, idxs, win->n_copy, off);
        ggml_tensor * to   = ggml_view_1d(ctx, idxs, win->n_copy, off + win->n_copy*idxs->nb[0]);
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, rows, ggml_get_rows(ctx, rows, from), to));
        // then this batch's scores: each key before RoPE against the file's mean query, Q̄·k (llama_kvq_prerope_store's
        // (k - mean) / scale names its input)
        char name[GGML_MAX_NAME];
        snprintf(name, sizeof(name), "k_prerope-%d", il);
        ggml_tensor * c = kvq_find_node(k_cur, name, 4);
        GGML_ASSERT(c != nullptr && c->op == GGML_OP_DIV && c->src[0]->op == GGML_OP_SUB);
        ggml_tensor * k_pre = c->src[0]->src[0];
        ggml_tensor * qm = win->q_mean[ikv];
        GGML_ASSERT(ggml_nelements(qm) == k_pre->ne[0]*k_pre->ne[1]);
        ggml_tensor * k2 = ggml_reshape_2d(ctx, ggml_cont(ctx, k_pre), k_pre->ne[0]*k_pre->ne[1], n_tokens);
        ggml_tensor * s  = ggml_mul_mat(ctx, k2, ggml_reshape_2d(ctx, qm, ggml_nelements(qm), 1));   // [n_tokens, 1]
        const int64_t n_s = std::min<int64_t>(n_tokens, win->n_stage);   // tokens past the stage keep no row
        ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_view_1d(ctx, s, n_s, 0), ggml_view_1d(ctx, win->scores[ikv], n_s, 0)));
    }
    const int64_t n_k = k_cur->ne[0]*k_cur->ne[1], n_v = v_cur->ne[0]*v_cur->ne[1];
    GGML_ASSERT(n_k + n_v == rows->ne[0]);
    GGML_ASSERT(ggml_row_size(k_cur->type, k_cur->ne[0]) == k_cur->nb[1] && ggml_row_size(v_cur->type, v_cur->ne[0]) == v_cur->nb[1]);
    ggml_tensor * k2 = ggml_view_2d(ctx, k_cur, n_k, n_tokens, k_cur->nb[2], 0);
    ggml_tensor * v2 = ggml_view_2d(ctx, v_cur, n_v, n_tokens, v_cur->nb[2], 0);
    ggml_tensor * rk = ggml_view_2d(ctx, rows, n_k, rows->ne[1], rows->nb[1], 0);
    ggml_tensor * rv = ggml_view_2d(ctx, rows, n_v, rows->ne[1], rows->nb[1], ggml_row_size(rows->type, n_k));
    // the stage rows now; the ring after this layer's attention has read the rows it held (kvq_win_attach)
    ggml_tensor * stage = ggml_view_1d(ctx, idxs, n_tokens, 0);
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, rk, k2, stage));
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, rv, v2, stage));
    win->keep[kv.map_layer_ids.at(il)] = { ctx, gf, k2, v2, ggml_view_1d(ctx, idxs, n_tokens, n_tokens*idxs->nb[0]) };
}

void llama_kvq_cache::win_attach(ggml_tensor * fa, int32_t il) const {
    if (!win) {
        return;
    }
    const size_t ikv = kv.map_layer_ids.at(il);
    ggml_tensor * rows = win->rows[ikv];
    if (rows == nullptr) {
        return;
    }
    auto & kw = win->keep[ikv];
    if (win->layer_pos[ikv] != nullptr && kw.gf != nullptr) {
        // heavy hitters: the layer's own planes; the shared input stays in the graph (its inputs fill the layers')
        ggml_build_forward_expand(kw.gf, fa->src[5]);
        fa->src[5] = win->layer_pos[ikv];
    }
    ggml_kvq_fa_set_window(fa, rows);
    // the batch's rows move into the ring once attention has read the ring: nodes run in the order they were added,
    // so attention is added first (nothing else orders a write after a read of the same tensor)
    if (kw.ctx != nullptr) {
        ggml_build_forward_expand(kw.gf, fa);
        const int64_t n_k = kw.k2->ne[0], n_v = kw.v2->ne[0];
        ggml_tensor * rk = ggml_view_2d(kw.ctx, rows, n_k, rows->ne[1], rows->nb[1], 0);
        ggml_tensor * rv = ggml_view_2d(kw.ctx, rows, n_v, rows->ne[1], rows->nb[1], ggml_row_size(rows->type, n_k));
        ggml_build_forward_expand(kw.gf, ggml_set_rows(kw.ctx, rk, kw.k2, kw.idxs));
        ggml_build_forward_expand(kw.gf, ggml_set_rows(kw.ctx, rv, kw.v2, kw.idxs));
        kw = {};
    }
}

// ---- states ---------------------------------------------------------------------------------------------------
// After a stream's V rows a state carries the exact rows of its saved cells (flagged in the v_trans word, so a
// reader without a window skips them): a restored sequence reads what it read before. Rows go sinks first, then
// each ring oldest to newest; the reader puts a row whose position is below its n_sink in that sink, and the newest
// n_win of the others in its ring, so a reader with another window keeps what fits.
//   uint32 n_rows; n_rows × uint32 (the cell's index among the saved ones)
//   uint32 n_layer; per layer: uint32 row bytes (0: none), n_rows rows

uint32_t llama_kvq_cache::win_state_flag() const {
    return win ? LLAMA_KVQ_STATE_WINDOW : 0;
}

void llama_kvq_cache::win_state_write(llama_io_write_i & io, const cell_ranges_t & cr) const {
    if (!win) {
        return;
    }
    const auto & w = *win;
    std::vector<int32_t> ord(kv.v_cells[cr.strm].size(), -1);
    uint32_t n_saved = 0;
    for (const auto & range : cr.data) {
        for (uint32_t i = range.first; i < range.second; ++i) {
            ord[i] = (int32_t) n_saved++;
        }
    }
    std::vector<uint32_t> slots, ords;
    auto take = [&](uint32_t slot) {
        const int32_t cell = w.slot_cell[cr.strm][slot];
        if (cell >= 0 && w.cell_slot[cr.strm][cell] == (int32_t) slot && ord[cell] >= 0) {
            slots.push_back(slot);
            ords.push_back((uint32_t) ord[cell]);
        }
    };
    for (uint32_t q = 0; q < w.n_seq; ++q) {
        for (uint32_t i = 0; i < w.n_sink; ++i) {
            take(w.base(q) + i);
        }
        for (uint32_t i = 0; i < w.n_win; ++i) {
            take(w.base(q) + w.n_sink + (w.next[cr.strm][q] + i) % w.n_win);
        }
    }
    const uint32_t n_rows = (uint32_t) slots.size(), n_layer = (uint32_t) layers.size();
    io.write(&n_rows, sizeof(n_rows));
    io.write(ords.data(), ords.size()*sizeof(uint32_t));
    io.write(&n_layer, sizeof(n_layer));
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        ggml_tensor * rows = w.rows[ikv];
        const uint32_t row_bytes = rows ? (uint32_t) rows->nb[1] : 0;
        io.write(&row_bytes, sizeof(row_bytes));
        for (uint32_t r = 0; rows && r < n_rows; ++r) {
            io.write_tensor(rows, ((size_t) cr.strm*w.n_slot + slots[r])*row_bytes, row_bytes);
        }
    }
}

// the restored cells' exact rows are no longer theirs, and a restored sequence's slots start empty
void llama_kvq_cache::win_forget(uint32_t strm, const slot_info & sinfo) const {
    if (!win || strm >= win->next.size() || sinfo.empty()) {
        return;
    }
    auto & w = *win;
    const auto & cells = kv.v_cells[strm];
    // heavy hitters: the restored cells hold other keys now, and the last batch's stage rows are not theirs
    std::vector<uint8_t> restored(cells.size(), 0);
    for (uint32_t idx : sinfo.idxs[0]) {
        restored[idx] = 1;
    }
    for (size_t ikv = 0; ikv < w.heavy_cell.size(); ++ikv) {
        if (w.heavy_on(ikv)) {
            for (int32_t & cell : w.heavy_cell[ikv][strm]) {
                cell = cell >= 0 && restored[cell] ? -1 : cell;
            }
        }
    }
    w.last_stage.clear();
    std::vector<bool> seqs(w.n_seq, false);
    for (uint32_t idx : sinfo.idxs[0]) {
        const int32_t slot = w.cell_slot[strm][idx];
        if (slot >= 0 && w.slot_cell[strm][slot] == (int32_t) idx) {
            w.slot_cell[strm][slot] = -1;
        }
        w.cell_slot[strm][idx] = -1;
        for (uint32_t q = 0; q < w.n_seq; ++q) {
            seqs[q] = seqs[q] || cells.seq_has(idx, (llama_seq_id) q);
        }
    }
    for (uint32_t q = 0; q < w.n_seq; ++q) {
        if (!seqs[q] && w.n_seq > 1) {
            continue;
        }
        for (uint32_t slot = w.base(q); slot < w.base(q) + w.n_sink + w.n_win; ++slot) {
            const int32_t cell = w.slot_cell[strm][slot];
            if (cell >= 0 && w.cell_slot[strm][cell] == (int32_t) slot) {
                w.cell_slot[strm][cell] = -1;
            }
            w.slot_cell[strm][slot] = -1;
        }
        w.next[strm][q] = 0;
    }
}

bool llama_kvq_cache::win_state_read(llama_io_read_i & io, uint32_t strm, uint32_t cell_count, const slot_info & sinfo) {
    uint32_t n_rows = 0, n_layer = 0;
    io.read(&n_rows, sizeof(n_rows));
    if (n_rows > cell_count) {
        LLAMA_LOG_ERROR("%s: the state's exact window holds %u rows for %u cells\n", __func__, n_rows, cell_count);
        return false;
    }
    std::vector<uint32_t> ords(n_rows);
    io.read(ords.data(), ords.size()*sizeof(uint32_t));
    for (uint32_t o : ords) {
        if (o >= cell_count) {
            LLAMA_LOG_ERROR("%s: the state's exact window names cell %u of %u\n", __func__, o, cell_count);
            return false;
        }
    }
    io.read(&n_layer, sizeof(n_layer));
    if (n_layer != layers.size()) {
        LLAMA_LOG_ERROR("%s: the state's exact window has %u layers, the cache %zu\n", __func__, n_layer, layers.size());
        return false;
    }
    // where each row goes: a sink by its position, the newest n_win others of its sequence into the ring (filled:
    // how many ring slots of each sequence that takes)
    std::vector<int32_t> dest(n_rows, -1);
    std::vector<uint32_t> filled(win ? win->n_seq : 0, 0);
    if (win) {
        const auto & w = *win;
        const auto & cells = kv.v_cells[strm];
        std::vector<std::vector<uint32_t>> ring(w.n_seq);
        for (uint32_t r = 0; r < n_rows; ++r) {
            const uint32_t cell = sinfo.idxs[0][ords[r]];
            const llama_pos p = cells.pos_get(cell);
            uint32_t q = 0;
            while (q + 1 < w.n_seq && !cells.seq_has(cell, (llama_seq_id) q)) {
                ++q;
            }
            if (p >= 0 && (uint32_t) p < w.n_sink) {
                dest[r] = (int32_t) (w.base(q) + (uint32_t) p);
            } else {
                ring[q].push_back(r);
            }
        }
        for (uint32_t q = 0; q < w.n_seq; ++q) {
            const size_t k0 = ring[q].size() > w.n_win ? ring[q].size() - w.n_win : 0;
            for (size_t k = k0; k < ring[q].size(); ++k) {
                dest[ring[q][k]] = (int32_t) (w.base(q) + w.n_sink + (k - k0));
            }
            filled[q] = (uint32_t) (ring[q].size() - k0);
        }
    }
    std::vector<uint8_t> skip;
    bool complete = true; // every layer with a window got its rows (else no cell claims one: a row would be stale)
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        uint32_t row_bytes = 0;
        io.read(&row_bytes, sizeof(row_bytes));
        ggml_tensor * rows = win ? win->rows[ikv] : nullptr;
        // f16 or q8_0 K and V of one cell, whether or not this cache keeps a window (a damaged state asks for no more)
        const uint32_t il = kv.layers[ikv].il;
        const int64_t n_el = kv.hparams.n_embd_k_gqa(il) + kv.hparams.n_embd_v_gqa(il);
        const ggml_type from = row_bytes == ggml_row_size(GGML_TYPE_F16, n_el) ? GGML_TYPE_F16 : GGML_TYPE_Q8_0;
        if (row_bytes != 0 && (row_bytes != ggml_row_size(from, n_el) || n_el % ggml_blck_size(from) != 0)) {
            LLAMA_LOG_ERROR("%s: layer %u: the state's exact rows are %u bytes, neither f16 nor q8_0 rows of the cache's %lld "
                            "values\n", __func__, il, row_bytes, (long long) n_el);
            return false;
        }
        complete = complete && (rows == nullptr || row_bytes != 0);
        std::vector<float> f32;
        std::vector<uint8_t> row;
        for (uint32_t r = 0; r < n_rows && row_bytes != 0; ++r) {
            const uint32_t slot = rows == nullptr ? 0 : dest[r] >= 0 ? (uint32_t) dest[r] : win->trash();
            if (rows && rows->type == from) { // a row that finds no slot goes to the trash slot (a device state's reader takes tensor reads only)
                io.read_tensor(rows, ((size_t) strm*win->n_slot + slot)*row_bytes, row_bytes);
            } else if (rows) {                // a state saved with the other row type: converted (q8_0 <-> f16)
                skip.resize(row_bytes);
                io.read(skip.data(), row_bytes);
                f32.resize(n_el);
                ggml_get_type_traits(from)->to_float(skip.data(), f32.data(), n_el);
                row.resize(rows->nb[1]);
                ggml_get_type_traits(rows->type)->from_float_ref(f32.data(), row.data(), n_el);
                ggml_backend_tensor_set(rows, row.data(), ((size_t) strm*win->n_slot + slot)*rows->nb[1], rows->nb[1]);
            } else {
                skip.resize(row_bytes);
                io.read(skip.data(), row_bytes);
            }
        }
    }
    if (!win || !complete) {
        return true;
    }
    auto & w = *win;
    for (uint32_t r = 0; r < n_rows; ++r) {
        if (dest[r] >= 0) {
            const uint32_t cell = sinfo.idxs[0][ords[r]];
            w.slot_cell[strm][dest[r]] = (int32_t) cell;
            w.cell_slot[strm][cell] = dest[r];
        }
    }
    for (uint32_t q = 0; q < w.n_seq; ++q) {
        if (filled[q] > 0) { // the other sequences' rings go on where they were
            w.next[strm][q] = filled[q] % w.n_win;
        }
    }
    return true;
}
