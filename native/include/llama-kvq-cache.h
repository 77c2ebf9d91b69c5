#pragma once

// pykvq: its state of one llama_kv_cache (the cache's `kvq` member; the KV cache seam): each layer's nuq codebooks and
// key domain (pre-RoPE statistics, a centred mean), the q4_0 / q5_0 writes' encoder and the exact window. The cache
// calls it from one-line hooks; llama_kv_cache and llama_kv_cache_context name this struct their friend, so its
// functions read the cache's layers and cells and a context's slots without upstream gaining members of ours.
// Bodies: native/llama/llama-kvq-memory.cpp (codebooks, key domain, states), llama-kvq-window.cpp (the window).

#include "llama-kvq-codebooks.h"
#include "llama-kvq-prerope.h"
#include "llama-kvq-settings.h"
#include "llama-kv-cache.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

struct llama_io_write_i;
struct llama_io_read_i;
struct llama_kvq_layer_desc;

// session states: each layer's K / V type word also says what else decodes the bytes: a pre-RoPE K layer sets
// LLAMA_KVQ_STATE_PREROPE, a centred one LLAMA_KVQ_STATE_CENTRED, a cache turned by upstream's online Hadamard (attn_rot_k / attn_rot_v) sets
// LLAMA_KVQ_STATE_ROT, a file codebook puts its fingerprint (1..255) in bits 20..27 (type ids stay far below)
#define LLAMA_KVQ_STATE_PREROPE  0x10000
#define LLAMA_KVQ_STATE_ROT      0x20000
#define LLAMA_KVQ_STATE_CENTRED  0x40000
#define LLAMA_KVQ_STATE_CB_SHIFT 20
// a stream's v_trans word: its exact-window rows follow its V rows (llama-kvq-window.cpp)
#define LLAMA_KVQ_STATE_WINDOW   0x10000

// the type word a state records for a layer's cache tensor (native/llama/llama-kvq-memory.cpp)
int32_t     llama_kvq_state_type_word(ggml_type type, const int8_t * cb, int k_domain /* 0 post, 1 pre, 2 centred */, bool rot);
// "" when a state's word (have) fits this context's (want), else why not, naming K or V
std::string llama_kvq_state_mismatch(int32_t have, int32_t want, char which);

// the exact window of a pre-RoPE key cache (native/llama/llama-kvq-window.cpp)
struct llama_kvq_window;
// planes 1-3 of the positions input at cell j of stream strm, as this batch's attention reads them: the cell's row in
// the layers' window tensors (-1: its quantized row), the last query position reading that row, query j's position
void llama_kvq_window_planes(const llama_kvq_window & w, uint32_t strm, uint32_t j, int32_t * row, int32_t * last, int32_t * qpos);
// heavy hitters: each keeping layer's positions input for this graph (I32 like pos), and its data: pos's planes (data,
// streams from s0) with the layer's members' rows patched in
void llama_kvq_window_layer_pos(const llama_kvq_window & w, ggml_context * ctx, const ggml_tensor * pos);
void llama_kvq_window_set_layer_pos(const llama_kvq_window & w, const std::vector<llama_kv_cells> & v_cells, uint32_t s0,
                                    int64_t n_kv, const std::vector<int32_t> & data);

struct llama_kvq_cache {
    using slot_info     = llama_kv_cache::slot_info;
    using cell_ranges_t = llama_kv_cache::cell_ranges_t;

    // per cache layer, in the order of llama_kv_cache::layers
    struct layer {
        const int8_t * cb_k = nullptr;   // the file's nuq codebooks (owned by the model); nullptr: the type's fallback, or not nuq
        const int8_t * cb_v = nullptr;
        ggml_tensor * k_mean  = nullptr; // a pre-RoPE K cache stores (k - k_mean) / k_scale (model tensors); nullptr: post-RoPE
        ggml_tensor * k_scale = nullptr;
        ggml_tensor * q_mean  = nullptr; // the file's mean query per KV head's group (heavy hitters' score); nullptr: none
        std::vector<float> k_centre;     // a centred post-RoPE K cache stores R(p)(k - k_centre): F32 [DK, n_head_kv]; empty: not
    };

    // the file's codebook for each layer's type (throws naming the tensor when one is invalid)
    explicit llama_kvq_cache(llama_kv_cache & kv);

    llama_kv_cache &   kv;
    std::vector<layer> layers;
    uint32_t n_prerope = 0;                     // layers with a pre-RoPE K cache
    uint32_t n_centred = 0;                     // layers with a centred post-RoPE K cache
    int      encoder   = GGML_KVQ_ENCODER_STOCK; // q4_0 / q5_0 cache writes' encoder
    std::shared_ptr<llama_kvq_window> win;      // exact window and sinks; nullptr: none

    // the pykvq state of a cache, of the cache a context reads
    static llama_kvq_cache &       of(llama_kv_cache & kv) { return *kv.kvq; }
    static const llama_kvq_cache & of(const llama_kv_cache_context * mctx) { return *mctx->kv->kvq; }

    // a context's settings, once after the cache is made (llama_kvq_init_memory)
    void     set_attn_rot(llama_attn_rot_type rot_k, llama_attn_rot_type rot_v); // AUTO keeps the constructor's choice
    uint32_t set_k_domain(const llama_kvq_ctx_opts & opts);                      // returns the pre-RoPE or centred layers
    // returns the layers that keep one; row_type F16 or Q8_0 (CPU / CUDA layers; an RPC worker's keep F16)
    // heavy: the fraction of each sequence's cells kept exact as heavy hitters (llama-kvq-window.cpp)
    uint32_t set_window(uint32_t n_win, uint32_t n_sink, uint32_t n_ubatch, ggml_type row_type = GGML_TYPE_F16,
                        double heavy = 0.0);
    void     describe(std::vector<llama_kvq_layer_desc> & out) const;            // fills out[il] for the layers it holds
    std::pair<uint32_t, uint32_t> window_size() const;                          // {sinks, window} kept exact ({0, 0}: none)
    const char * window_type() const;                                           // its rows' type ("f16" / "q8_0"), "" for none
    uint32_t heavy_size() const;                                                // heavy-hitter slots per sequence (0: none)

    // "q4_0", or "mixed: q8_0 1.23 MiB q4_0 4.56 MiB" when the layers' K (V) tensors differ in type; any of them quantized
    std::string types_str(bool v) const;
    bool        any_quantized(bool v) const;

    // what the graph reads of model layer il
    const int8_t * codebook(int32_t il, bool v) const;
    std::pair<ggml_tensor *, ggml_tensor *> prerope(int32_t il) const;           // {k_mean, k_scale}, {nullptr, nullptr}: not pre-RoPE
    const std::vector<float> * centred(int32_t il) const;                       // the kept mean pairs, nullptr: not centred

    // cache writes (llama_kv_cache::cpy_k / cpy_v): the SET_ROWS node told its codebook and encoder; k_cur is checked
    // to be centred pre-RoPE keys where the layer is pre-RoPE
    ggml_tensor * cpy_k(ggml_tensor * set_rows, const ggml_tensor * k_cur, int32_t il) const;
    ggml_tensor * cpy_v(ggml_tensor * set_rows, int32_t il) const;

    // I32 [n_kv, n_stream(, 4 with a window)]: each cell's position (pre-RoPE and centred layers read it); with heavy
    // hitters each layer that keeps them reads its own (made here, filled by set_input_k_pos)
    static ggml_tensor * build_input_k_pos(const llama_kv_cache_context * mctx, ggml_context * ctx);
    static void          set_input_k_pos(const llama_kv_cache_context * mctx, ggml_tensor * dst);

    // the exact window (llama-kvq-window.cpp)
    ggml_tensor * build_input_win_idxs(ggml_context * ctx, const llama_ubatch & ubatch) const;
    static void   set_input_win_idxs(const llama_kv_cache_context * mctx, ggml_tensor * dst, const llama_ubatch * ubatch);
    void win_write(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * k_cur, ggml_tensor * v_cur, ggml_tensor * idxs, int32_t il) const;
    void win_attach(ggml_tensor * fa, int32_t il) const;
    void win_copy_stream(uint32_t ssrc, uint32_t sdst) const;   // a stream copy: the copied cells keep their rows

    // session states: the type word of layer il's K / V tensor (llama_kvq_state_type_word), and the window's section
    // after a stream's V rows (LLAMA_KVQ_STATE_WINDOW in its v_trans word)
    int32_t  state_word(int32_t il, bool v) const;
    uint32_t win_state_flag() const;
    void     win_state_write(llama_io_write_i & io, const cell_ranges_t & cr) const;
    bool     win_state_read(llama_io_read_i & io, uint32_t strm, uint32_t cell_count, const slot_info & sinfo);
    void     win_forget(uint32_t strm, const slot_info & sinfo) const;

private:
    uint32_t set_centred(const llama_kvq_ctx_opts & opts);
    const layer & at(int32_t il) const { return layers[kv.map_layer_ids.at(il)]; }
};
