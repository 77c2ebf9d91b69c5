// pykvq: the cache types in ggml-cuda (the CUDA dispatch seam calls the two entry points below).
//
//   SET_ROWS f32 -> type      quantize on write, one thread per block (the codec of kvq-codec.cuh,
//                             bit for bit the reference quantizer); also stock q4_0 / q5_0 where the
//                             node asks for least-squares scales (a pykvq-converted file's cache)
//   CPY f32 -> type, type -> f32 / f16   the K-shift round trip (same shapes); type -> same type
//                             (contiguous: cache copies) as bytes
//   FLASH_ATTN_EXT            one query token and a compiled K/V pair: kvq-fattn.cuh's decode
//                             kernel on the quantized cache; otherwise (prefill, other pairs,
//                             other head sizes) K and V are decoded to f16 in pool memory and
//                             upstream's f16 flash attention runs on them. A pre-RoPE K cache
//                             (ggml-kvq.h) is turned into post-RoPE keys on the way: per K row
//                             in the decode kernel, per converted row in the prefill path
//                             (kvq-prerope.cuh); a centred one gets its rotated mean back there
// Everything else that touches a pykvq type is declined in supports_op, so the scheduler
// never sees a claim it cannot honour.
#include "common.cuh"
#include "convert.cuh"
#include "fattn.cuh"

#include "ggml-kvq-cuda.h"
#include "kvq-codec.cuh"
#include "kvq-fattn.cuh"
#include "kvq-rows.cuh"

#include <cstring>

#define KVQ_CUDA_BLOCK 128

// slot A (quantize / K) or slot B (dequantize / V) of a node, else the fallback of `type`
static kvq_cb kvq_node_codebook(const ggml_tensor * node, ggml_type type, bool slot_b) {
    kvq_cb cb = {};
    if (!ggml_kvq_is_nuq(type)) {
        return cb;
    }
    int8_t a[16], b[16];
    const unsigned bits = ggml_kvq_get_codebooks(node, a, b);
    const int n = ggml_kvq_nuq_n_codes(type);
    if (bits & (slot_b ? 2u : 1u)) {
        memcpy(cb.c, slot_b ? b : a, 16);
    } else {
        memcpy(cb.c, ggml_kvq_nuq_fallback(type), (size_t) n);
    }
    return cb;
}

// switch (type) calling F(GGML_TYPE_X, ...) for each type with CUDA kernels (ggml-kvq-types.h's cuda column)
#define KVQ_TYPE_CASE_ROW(name, NAME, id, qk, family, vdt, VDT, cuda, codes, outl, bits, F, ...) \
    GGML_KVQ_IF(cuda)(case GGML_TYPE_##NAME: F(GGML_TYPE_##NAME, __VA_ARGS__); break;)
#define KVQ_TYPE_CASES(F, ...)                                                   \
    switch (type) {                                                              \
        GGML_KVQ_TYPES(KVQ_TYPE_CASE_ROW, F, __VA_ARGS__)                        \
        default: GGML_ABORT("pykvq: %s is not a pykvq type with CUDA kernels", ggml_type_name(type)); \
    }

// the types a SET_ROWS / CPY quantizes into: pykvq's, and stock q4_0 / q5_0 where a SET_ROWS asks for
// least-squares scales (ggml_kvq_set_encoder; kvq_lsq_write)
#define KVQ_QUANT_CASES(F, ...)                                                   \
    if (type == GGML_TYPE_Q4_0) {                                                 \
        F(GGML_TYPE_Q4_0, __VA_ARGS__);                                           \
    } else if (type == GGML_TYPE_Q5_0) {                                          \
        F(GGML_TYPE_Q5_0, __VA_ARGS__);                                           \
    } else {                                                                      \
        KVQ_TYPE_CASES(F, __VA_ARGS__)                                            \
    }

// a cache write pykvq encodes although the type is stock: q4_0 / q5_0 with least-squares scales
static bool kvq_lsq_write(const ggml_tensor * op) {
    return op->op == GGML_OP_SET_ROWS && (op->type == GGML_TYPE_Q4_0 || op->type == GGML_TYPE_Q5_0) &&
           ggml_kvq_get_encoder(op) == GGML_KVQ_ENCODER_LSQ;
}

static int kvq_grid(int64_t total) {
    return (int) ((total + KVQ_CUDA_BLOCK - 1) / KVQ_CUDA_BLOCK);
}

// src (a type's tensor, rows contiguous) -> dst_t rows at the given byte strides
template <typename dst_t>
static void kvq_dequant_cuda(const ggml_tensor * src, const kvq_cb & cb, dst_t * dst,
                             const int64_t nb1, const int64_t nb2, const int64_t nb3, cudaStream_t stream) {
    const ggml_type type   = src->type;
    const int64_t   nchunk = src->ne[0] / 8;
    const int64_t   total  = nchunk*src->ne[1]*src->ne[2]*src->ne[3];
    if (total == 0) {
        return;
    }
#define KVQ_DQ(T, ...) kvq_dequant<T, dst_t><<<kvq_grid(total), KVQ_CUDA_BLOCK, 0, stream>>>( \
        (const char *) src->data, dst, cb, nchunk, src->ne[1], src->ne[2], total,           \
        src->nb[1], src->nb[2], src->nb[3], nb1, nb2, nb3)
    KVQ_TYPE_CASES(KVQ_DQ, 0)
#undef KVQ_DQ
    CUDA_CHECK(cudaGetLastError());
}

// least-squares types: a warp per block of values (kvq_quantize_rows_lsq), the rest a thread per block
template <ggml_type T, typename idx_t>
static void kvq_quantize_launch(const ggml_tensor * dst, const ggml_tensor * idx, const kvq_cb & cb, const int64_t nblk,
                                const int64_t total, cudaStream_t stream) {
    const ggml_tensor * src0 = dst->src[0];
    const char * s = (const char *) src0->data;
    const char * r = idx ? (const char *) idx->data : nullptr;
    char       * d = (char *) dst->data;
    const int64_t ne11 = idx ? idx->ne[1] : 1, ne12 = idx ? idx->ne[2] : 1;
    const int64_t nb10 = idx ? idx->nb[0] : 0, nb11 = idx ? idx->nb[1] : 0, nb12 = idx ? idx->nb[2] : 0;
    if constexpr (kvq_is_lsq<T>()) {
        kvq_quantize_rows_lsq<T, idx_t><<<(int) ((total + KVQ_LSQ_WARPS - 1)/KVQ_LSQ_WARPS), dim3(WARP_SIZE, KVQ_LSQ_WARPS, 1),
                                          0, stream>>>(s, r, d, nblk, src0->ne[1], src0->ne[2], total, src0->nb[1],
                                                       src0->nb[2], src0->nb[3], ne11, ne12, nb10, nb11, nb12,
                                                       dst->nb[1], dst->nb[2], dst->nb[3]);
    } else {
        kvq_quantize_rows<T, idx_t><<<kvq_grid(total), KVQ_CUDA_BLOCK, 0, stream>>>(
            s, r, d, cb, nblk, src0->ne[1], src0->ne[2], total, src0->nb[1], src0->nb[2], src0->nb[3], ne11, ne12,
            nb10, nb11, nb12, dst->nb[1], dst->nb[2], dst->nb[3]);
    }
}

// SET_ROWS (idx = its row indices) and CPY f32 -> type (idx = NULL: row i to row i)
static void kvq_quantize_cuda(ggml_backend_cuda_context & ctx, ggml_tensor * dst, const ggml_tensor * idx) {
    const ggml_tensor * src0 = dst->src[0];
    const ggml_type     type = dst->type;
    const kvq_cb        cb   = kvq_node_codebook(dst, type, false);
    const int64_t nblk  = src0->ne[0] / ggml_blck_size(type);
    const int64_t total = nblk*src0->ne[1]*src0->ne[2]*src0->ne[3];
    if (total == 0) {
        return;
    }
    cudaStream_t stream = ctx.stream();
#define KVQ_Q(T, idx_t) kvq_quantize_launch<T, idx_t>(dst, idx, cb, nblk, total, stream)
    if (idx && idx->type == GGML_TYPE_I32) {
        KVQ_QUANT_CASES(KVQ_Q, int32_t)
    } else {
        KVQ_QUANT_CASES(KVQ_Q, int64_t)
    }
#undef KVQ_Q
    CUDA_CHECK(cudaGetLastError());
}

static void kvq_cpy_cuda(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * src0   = dst->src[0];
    cudaStream_t        stream = ctx.stream();
    if (src0->type == dst->type) {
        if (src0->data != dst->data) {
            CUDA_CHECK(cudaMemcpyAsync(dst->data, src0->data, ggml_nbytes(dst), cudaMemcpyDeviceToDevice, stream));
        }
        return;
    }
    if (ggml_kvq_type_has_cuda(dst->type)) {
        kvq_quantize_cuda(ctx, dst, nullptr);
        return;
    }
    const kvq_cb cb = kvq_node_codebook(dst, src0->type, true);
    if (dst->type == GGML_TYPE_F32) {
        kvq_dequant_cuda(src0, cb, (float *) dst->data, dst->nb[1], dst->nb[2], dst->nb[3], stream);
    } else {
        kvq_dequant_cuda(src0, cb, (half *) dst->data, dst->nb[1], dst->nb[2], dst->nb[3], stream);
    }
}

// ---- flash attention -------------------------------------------------------------------------

static bool kvq_fa_stock_to_f16(ggml_type type) {
    return type == GGML_TYPE_F16 || type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q4_0;
}

// t with f16 type and contiguous strides (the layout the prefill path decodes into)
static void kvq_f16_like(ggml_tensor * out, const ggml_tensor * t) {
    *out = *t;
    out->type  = GGML_TYPE_F16;
    out->nb[0] = sizeof(half);
    out->nb[1] = out->nb[0]*t->ne[0];
    out->nb[2] = out->nb[1]*t->ne[1];
    out->nb[3] = out->nb[2]*t->ne[2];
}

static void kvq_fattn_standin(const ggml_tensor * op, ggml_kvq_cuda_standin * s) {
    s->node = *op;
    kvq_f16_like(&s->k, op->src[1]);
    kvq_f16_like(&s->v, op->src[2]);
    s->node.src[1] = &s->k;
    s->node.src[2] = &s->v;
    // the stand-in's K is post-RoPE already: a plain f16 FLASH_ATTN_EXT for upstream
    for (int i = 5; i < GGML_MAX_SRC; ++i) {
        s->node.src[i] = nullptr;
    }
    const int32_t none = 0;
    memcpy(s->node.op_params + GGML_KVQ_PREROPE_TAG, &none, sizeof(none));
}

// the node's pre-RoPE arguments (ggml-kvq.h); false when the node reads a post-RoPE K
static bool kvq_fa_prerope_args(const ggml_tensor * op, kvq_prerope_args * p) {
    int n_dims, mode, n_rot_h;
    float mscale;
    if (!ggml_kvq_fa_get_prerope(op, &n_dims, &mode, &mscale, &n_rot_h)) {
        return false;
    }
    const ggml_tensor * pos = op->src[5];
    *p = {};
    p->pos        = (const int32_t *) pos->data;
    p->pos_stride = pos->nb[1] / (int64_t) sizeof(int32_t);
    p->mean       = (const float *) op->src[6]->data;
    p->scale      = (const float *) op->src[7]->data;
    p->freqs      = (const float *) op->src[8]->data;
    p->n_dims     = n_dims;
    p->neox       = mode == GGML_ROPE_TYPE_NEOX;
    p->n_rot_h    = n_rot_h;
    p->h_skip     = n_rot_h ? ggml_kvq_fa_get_hadamard_skip(op) : 0;
    p->h_norm     = n_rot_h ? (float) (1.0/sqrt((double) (p->h_skip ? n_rot_h/2 : n_rot_h))) : 1.0f;
    p->mscale     = mscale;
    p->centred    = ggml_kvq_fa_is_centred(op);
    return true;
}

// the node's exact window (ggml_kvq_fa_set_window; kvq-window.cuh); false when it reads none
static bool kvq_fa_window_args(const ggml_tensor * op, kvq_window_args * w) {
    const ggml_tensor * rows = ggml_kvq_fa_get_window(op);
    *w = {};
    if (rows == nullptr) {
        return false;
    }
    const ggml_tensor * pos   = op->src[5];
    const int32_t     * p     = (const int32_t *) pos->data;
    const int64_t       plane = pos->nb[2] / (int64_t) sizeof(int32_t);
    w->rows = (const char *) rows->data;
    w->q8   = rows->type == GGML_TYPE_Q8_0;
    w->nb1  = rows->nb[1];
    w->n    = (int) rows->ne[1];
    w->v0   = op->src[1]->ne[0]*op->src[1]->ne[2];
    w->row  = p + plane;
    if (pos->ne[2] >= 4) {
        w->last = p + 2*plane;
        w->qpos = p + 3*plane;
    }
    return true;
}

// a window these kernels read: f16 or q8_0 rows [K | V] of every KV head, planes as ggml_kvq_fa_set_window lays them
static bool kvq_fa_window_supported(const ggml_tensor * op) {
    const ggml_tensor * rows = ggml_kvq_fa_get_window(op);
    if (rows == nullptr) {
        return true;
    }
    const ggml_tensor * K = op->src[1];
    const ggml_tensor * V = op->src[2];
    const ggml_tensor * pos  = op->src[5];
    const ggml_tensor * mask = op->src[3];
    const bool f16 = rows->type == GGML_TYPE_F16 && rows->nb[0] == sizeof(half);
    const bool q8  = rows->type == GGML_TYPE_Q8_0 && rows->nb[0] == ggml_type_size(GGML_TYPE_Q8_0) &&
                     K->ne[0] % ggml_blck_size(GGML_TYPE_Q8_0) == 0 && V->ne[0] % ggml_blck_size(GGML_TYPE_Q8_0) == 0;
    return (f16 || q8) && rows->ne[2] == 1 && rows->ne[3] == 1 &&
           rows->ne[0] == K->ne[0]*K->ne[2] + V->ne[0]*V->ne[2] && rows->ne[1] < INT32_MAX &&
           (pos->ne[2] == 2 || pos->ne[2] == 4) && pos->ne[0] >= op->src[0]->ne[1] &&
           mask != nullptr && mask->type == GGML_TYPE_F16 && mask->nb[0] == sizeof(half);   // prefill rebuilds the mask
}

// the layouts and tensors the pre-RoPE kernels take (kvq-prerope.cuh)
static bool kvq_fa_prerope_supported(const ggml_tensor * op) {
    int n_dims, mode, n_rot_h;
    if (!ggml_kvq_fa_get_prerope(op, &n_dims, &mode, nullptr, &n_rot_h)) {
        return true;
    }
    const ggml_tensor * K = op->src[1];
    const ggml_tensor * pos = op->src[5];
    if (pos->type != GGML_TYPE_I32 || pos->nb[0] != sizeof(int32_t) || pos->ne[0] < K->ne[1] || pos->ne[1] != K->ne[3]) {
        return false;
    }
    for (int i = 6; i <= 8; ++i) {
        if (op->src[i] == nullptr || op->src[i]->type != GGML_TYPE_F32 || !ggml_is_contiguous(op->src[i])) {
            return false;
        }
    }
    return (mode == GGML_ROPE_TYPE_NORMAL || mode == GGML_ROPE_TYPE_NEOX) &&
           kvq_prerope_fits((int) K->ne[0], n_dims, mode == GGML_ROPE_TYPE_NEOX, n_rot_h, ggml_kvq_fa_get_hadamard_skip(op)) &&
           (ggml_kvq_type_has_cuda(K->type) || K->type == GGML_TYPE_F16 || K->type == GGML_TYPE_Q8_0 ||
            K->type == GGML_TYPE_Q4_0);
}

// K of a pre-RoPE cache -> post-RoPE f16 rows at s_t's contiguous layout
static void kvq_fa_prerope_k_to_f16(const ggml_tensor * t, const kvq_cb & cb, const kvq_prerope_args & p,
                                    ggml_tensor * s_t, ggml_cuda_pool_alloc<half> & buf, cudaStream_t stream) {
    buf.alloc(ggml_nelements(t));
    s_t->data = buf.ptr;
    const char * src = (const char *) t->data;
    int64_t nb1 = t->nb[1], nb2 = t->nb[2], nb3 = t->nb[3];
    ggml_type type = t->type;
    if (type == GGML_TYPE_Q4_0) {
        // no codec of ours: upstream's f16 conversion, then the read path in place
        const size_t ts = ggml_type_size(type);
        to_fp16_nc_cuda_t to_fp16 = ggml_get_to_fp16_nc_cuda(type);
        GGML_ASSERT(to_fp16 != nullptr && t->nb[0] == ts);
        to_fp16(t->data, buf.ptr, t->ne[0], t->ne[1], t->ne[2], t->ne[3], t->nb[1]/ts, t->nb[2]/ts, t->nb[3]/ts, stream);
        src = (const char *) buf.ptr;
        nb1 = s_t->nb[1]; nb2 = s_t->nb[2]; nb3 = s_t->nb[3];
        type = GGML_TYPE_F16;
    }
    const int64_t n_rows = t->ne[1]*t->ne[2]*t->ne[3];
    if (n_rows == 0) {
        return;
    }
    const dim3 block(WARP_SIZE, KVQ_CUDA_BLOCK/WARP_SIZE, 1);
    const int  grid = (int) ((n_rows + block.y - 1)/block.y);
    const int  n_kv = (int) t->ne[1], n_head_kv = (int) t->ne[2];
#define KVQ_PRE_D(D, T) kvq_prerope_k_to_f16<D, T><<<grid, block, 0, stream>>>(src, buf.ptr, p, cb, n_kv, n_head_kv, n_rows, nb1, nb2, nb3)
#define KVQ_PRE(T, ...)                                              \
    switch (t->ne[0]) {                                              \
        case 64:  KVQ_PRE_D(64, T);  break;                          \
        case 128: KVQ_PRE_D(128, T); break;                          \
        case 256: KVQ_PRE_D(256, T); break;                          \
        default: GGML_ABORT("pykvq: pre-RoPE K of head size %d", (int) t->ne[0]); \
    }
    if (type == GGML_TYPE_F16) {
        KVQ_PRE(GGML_TYPE_F16, 0)
    } else if (type == GGML_TYPE_Q8_0) {
        KVQ_PRE(GGML_TYPE_Q8_0, 0)
    } else {
        KVQ_TYPE_CASES(KVQ_PRE, 0)
    }
#undef KVQ_PRE
#undef KVQ_PRE_D
    CUDA_CHECK(cudaGetLastError());
}

// the stand-in's K or V (s_t, f16 and contiguous): t itself when it is f16 already (upstream
// reads f16 at any strides), else t decoded into buf
static void kvq_fa_to_f16(const ggml_tensor * t, const kvq_cb & cb, ggml_tensor * s_t,
                          ggml_cuda_pool_alloc<half> & buf, cudaStream_t stream) {
    if (t->type == GGML_TYPE_F16) {
        *s_t = *t;
        return;
    }
    buf.alloc(ggml_nelements(t));
    s_t->data = buf.ptr;
    if (ggml_kvq_type_has_cuda(t->type)) {
        kvq_dequant_cuda(t, cb, buf.ptr, s_t->nb[1], s_t->nb[2], s_t->nb[3], stream);
    } else {
        const size_t ts = ggml_type_size(t->type);
        GGML_ASSERT(t->nb[0] == ts);
        to_fp16_nc_cuda_t to_fp16 = ggml_get_to_fp16_nc_cuda(t->type);
        GGML_ASSERT(to_fp16 != nullptr);
        to_fp16(t->data, buf.ptr, t->ne[0], t->ne[1], t->ne[2], t->ne[3],
                t->nb[1]/ts, t->nb[2]/ts, t->nb[3]/ts, stream);
    }
}

// pool memory the window's stand-in lives in until upstream's kernel has run. Members in the order they are
// allocated: destroyed in reverse, as ggml-cuda's VMM pool requires (frees in reverse order of allocation)
struct kvq_window_bufs {
    ggml_cuda_pool_alloc<int32_t> inv, pos;
    ggml_cuda_pool_alloc<half>    kw, k, v, mask;
    explicit kvq_window_bufs(ggml_cuda_pool & pool) : inv(pool), pos(pool), kw(pool), k(pool), v(pool), mask(pool) {}
};

// The stand-in with the exact window (kvq-window.cuh): its K / V (post-RoPE f16, as converted) get the window's
// rows appended, padded to a multiple of 256 cells, and its mask says which of a cell and its row each query reads.
static void kvq_fattn_window_standin(const ggml_tensor * dst, const kvq_prerope_args & pre, const kvq_window_args & w,
                                     ggml_kvq_cuda_standin * s, kvq_window_bufs & b, cudaStream_t stream) {
    const ggml_tensor * K    = dst->src[1];
    const ggml_tensor * mask = dst->src[3];
    const int D      = (int) K->ne[0];
    const int n_kv   = (int) K->ne[1];
    const int n_head = (int) K->ne[2];
    const int n_str  = (int) K->ne[3];
    const int n_w    = w.n;
    const int n_all  = (int) GGML_PAD((int64_t) n_kv + n_w, 256);
    const int n_q    = (int) dst->src[0]->ne[1];
    const int n_qpad = (int) mask->ne[1];
    const int ne2    = (int) mask->ne[2];

    // which cell names each row, and the positions the rows' keys turn at
    b.inv.alloc((size_t) n_w*n_str);
    b.pos.alloc((size_t) n_w*n_str);
    CUDA_CHECK(cudaMemsetAsync(b.inv.ptr, 0xFF, (size_t) n_w*n_str*sizeof(int32_t), stream));
    kvq_win_inverse<<<kvq_grid((int64_t) n_kv*n_str), KVQ_CUDA_BLOCK, 0, stream>>>(w, pre.pos_stride, n_kv, n_str, b.inv.ptr);
    kvq_win_positions<<<kvq_grid((int64_t) n_w*n_str), KVQ_CUDA_BLOCK, 0, stream>>>(b.inv.ptr, pre.pos, pre.pos_stride, n_w, n_str, b.pos.ptr);

    // the rows' keys, post-RoPE: the prefill conversion over src[9]'s K part (an f16 / q8_0 view [D, n_w, n_head,
    // n_str], every stream the same rows) at those positions
    const ggml_type wt = w.q8 ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
    ggml_tensor rows_k = *K, kw;
    rows_k.type  = wt;
    rows_k.data  = (void *) w.rows;
    rows_k.ne[1] = n_w;
    rows_k.nb[0] = ggml_type_size(wt);
    rows_k.nb[1] = w.nb1;
    rows_k.nb[2] = kvq_window_offset(w, D);
    rows_k.nb[3] = 0;
    kvq_f16_like(&kw, &rows_k);
    kvq_prerope_args pw = pre;
    pw.pos        = b.pos.ptr;
    pw.pos_stride = n_w;
    kvq_fa_prerope_k_to_f16(&rows_k, kvq_cb{}, pw, &kw, b.kw, stream);

    // K and V with the rows appended
    const int64_t n_out = (int64_t) D*n_all*n_head*n_str;
    b.k.alloc(n_out);
    b.v.alloc(n_out);
    kvq_win_assemble<<<kvq_grid(n_out), KVQ_CUDA_BLOCK, 0, stream>>>(
        (const char *) s->k.data, s->k.nb[1], s->k.nb[2], s->k.nb[3],
        (const char *) kw.data, kw.nb[1], kw.nb[2], kw.nb[3], false, D, n_kv, n_w, n_all, n_head, n_str, b.k.ptr);
    kvq_win_assemble<<<kvq_grid(n_out), KVQ_CUDA_BLOCK, 0, stream>>>(
        (const char *) s->v.data, s->v.nb[1], s->v.nb[2], s->v.nb[3],
        w.rows + kvq_window_offset(w, w.v0), w.nb1, kvq_window_offset(w, D), 0, w.q8, D, n_kv, n_w, n_all, n_head, n_str,
        b.v.ptr);

    // the mask: per query, a cell or its exact row
    const int64_t n_mask = (int64_t) n_all*n_qpad*ne2*n_str;
    b.mask.alloc(n_mask);
    kvq_win_mask<<<kvq_grid(n_mask), KVQ_CUDA_BLOCK, 0, stream>>>(
        (const char *) mask->data, mask->nb[1], mask->nb[2], mask->nb[3], (int) mask->ne[3], w, pre.pos_stride, b.inv.ptr,
        n_kv, n_all, n_q, n_qpad, ne2, n_str, b.mask.ptr);
    CUDA_CHECK(cudaGetLastError());

    for (ggml_tensor * t : { &s->k, &s->v }) {
        t->ne[1] = n_all;
        kvq_f16_like(t, t);
        t->data = t == &s->k ? (void *) b.k.ptr : (void *) b.v.ptr;
    }
    s->mask = *mask;
    s->mask.ne[0] = n_all;
    s->mask.ne[3] = n_str;
    kvq_f16_like(&s->mask, &s->mask);
    s->mask.data = b.mask.ptr;
    s->node.src[3] = &s->mask;
}

static void kvq_fattn_prefill(ggml_backend_cuda_context & ctx, ggml_tensor * dst, const kvq_cb & cb_k, const kvq_cb & cb_v) {
    ggml_kvq_cuda_standin s;
    kvq_fattn_standin(dst, &s);
    ggml_cuda_pool_alloc<half> k16(ctx.pool()), v16(ctx.pool());
    kvq_window_bufs wb(ctx.pool());
    kvq_prerope_args pre;
    kvq_window_args  win;
    const bool is_pre = kvq_fa_prerope_args(dst, &pre);
    if (is_pre) {
        kvq_fa_prerope_k_to_f16(dst->src[1], cb_k, pre, &s.k, k16, ctx.stream());
    } else {
        kvq_fa_to_f16(dst->src[1], cb_k, &s.k, k16, ctx.stream());
    }
    kvq_fa_to_f16(dst->src[2], cb_v, &s.v, v16, ctx.stream());
    if (is_pre && kvq_fa_window_args(dst, &win)) {
        kvq_fattn_window_standin(dst, pre, win, &s, wb, ctx.stream());
    }
    ggml_cuda_flash_attn_ext(ctx, &s.node);
}

static bool kvq_fattn_decode(ggml_backend_cuda_context & ctx, ggml_tensor * dst, const kvq_cb & cb_k, const kvq_cb & cb_v) {
    const ggml_tensor * Q     = dst->src[0];
    const ggml_tensor * K     = dst->src[1];
    const ggml_tensor * V     = dst->src[2];
    const ggml_tensor * mask  = dst->src[3];
    const ggml_tensor * sinks = dst->src[4];
    const int D = (int) Q->ne[0];
    kvq_fattn_args a = {};
    const bool pre = kvq_fa_prerope_args(dst, &a.pre);
    if (pre) {
        kvq_fa_window_args(dst, &a.win);
    }
    if (Q->ne[1] != 1 || Q->type != GGML_TYPE_F32 || K->ne[0] != D || V->ne[0] != D ||
        !(D == 64 || D == 128 || D == 256) || Q->ne[2] % K->ne[2] != 0 ||
        (mask && mask->type != GGML_TYPE_F16) || (sinks && sinks->type != GGML_TYPE_F32) ||
        !kvq_fattn_vec_has_pair(K->type, V->type, pre) || !ggml_is_contiguous(dst)) {
        return false;
    }

    float scale, max_bias, softcap;
    memcpy(&scale,    (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&softcap,  (const float *) dst->op_params + 2, sizeof(float));
    if (softcap != 0.0f) {
        scale /= softcap;
    }
    const uint32_t n_head      = (uint32_t) Q->ne[2];
    const uint32_t n_head_log2 = 1u << (uint32_t) floorf(log2f((float) n_head));
    a.Q = (const char *) Q->data;
    a.K = (const char *) K->data;
    a.V = (const char *) V->data;
    a.mask = mask ? (const char *) mask->data : nullptr;
    a.scale = scale;
    a.softcap = softcap;
    a.max_bias = max_bias;
    a.m0 = powf(2.0f, -(max_bias       )/n_head_log2);
    a.m1 = powf(2.0f, -(max_bias / 2.0f)/n_head_log2);
    a.n_head_log2 = n_head_log2;
    a.ne02 = (int) Q->ne[2];
    a.ne11 = (int) K->ne[1];
    a.gqa  = (int) (Q->ne[2] / K->ne[2]);
    a.ne32 = mask ? (int) mask->ne[2] : 1;
    a.ne33 = mask ? (int) mask->ne[3] : 1;
    a.nb02 = Q->nb[2]; a.nb03 = Q->nb[3];
    a.nb11 = K->nb[1]; a.nb12 = K->nb[2]; a.nb13 = K->nb[3];
    a.nb21 = V->nb[1]; a.nb22 = V->nb[2]; a.nb23 = V->nb[3];
    a.nb32 = mask ? mask->nb[2] : 0;
    a.nb33 = mask ? mask->nb[3] : 0;
    memcpy(a.cb_k, cb_k.c, 16);
    memcpy(a.cb_v, cb_v.c, 16);

    const int n_kv_heads = (int) K->ne[2];
    const int n_seq      = (int) Q->ne[3];
    kvq_fattn_vec_plan(a, n_kv_heads, n_seq, ggml_cuda_info().devices[ggml_cuda_get_device()].nsm);

    cudaStream_t stream = ctx.stream();
    ggml_cuda_pool_alloc<float>  part(ctx.pool(), (size_t) n_seq*a.ne02*a.n_split*D);
    ggml_cuda_pool_alloc<float2> meta(ctx.pool(), (size_t) n_seq*a.ne02*a.n_split);
    a.part = part.ptr;
    a.meta = meta.ptr;

    bool ok = false;
    switch (D) {
        case 64:  ok = kvq_fattn_vec_d64 (a, K->type, V->type, pre, n_kv_heads, n_seq, stream); break;
        case 128: ok = kvq_fattn_vec_d128(a, K->type, V->type, pre, n_kv_heads, n_seq, stream); break;
        case 256: ok = kvq_fattn_vec_d256(a, K->type, V->type, pre, n_kv_heads, n_seq, stream); break;
    }
    GGML_ASSERT(ok);

    const dim3 grid(a.ne02, n_seq, 1);
    const float * sinks_d = sinks ? (const float *) sinks->data : nullptr;
    switch (D) {
        case 64:  kvq_fattn_combine< 64><<<grid, dim3(WARP_SIZE,  64/WARP_SIZE), 0, stream>>>(a.part, a.meta, sinks_d, (float *) dst->data, a.ne02, a.n_split); break;
        case 128: kvq_fattn_combine<128><<<grid, dim3(WARP_SIZE, 128/WARP_SIZE), 0, stream>>>(a.part, a.meta, sinks_d, (float *) dst->data, a.ne02, a.n_split); break;
        case 256: kvq_fattn_combine<256><<<grid, dim3(WARP_SIZE, 256/WARP_SIZE), 0, stream>>>(a.part, a.meta, sinks_d, (float *) dst->data, a.ne02, a.n_split); break;
    }
    CUDA_CHECK(cudaGetLastError());
    return true;
}

static void kvq_fattn_cuda(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * K = dst->src[1];
    const ggml_tensor * V = dst->src[2];
    const kvq_cb cb_k = kvq_node_codebook(dst, K->type, false);
    const kvq_cb cb_v = kvq_node_codebook(dst, V->type, true);
    if (!kvq_fattn_decode(ctx, dst, cb_k, cb_v)) {
        kvq_fattn_prefill(ctx, dst, cb_k, cb_v);
    }
}

// ---- entry points ----------------------------------------------------------------------------

static bool kvq_involved(const ggml_tensor * op) {
    if (ggml_kvq_type_has_cuda(op->type) || kvq_lsq_write(op)) {
        return true;
    }
    // a pre-RoPE K cache of any type: upstream's kernels would read it as rotated keys
    if (op->op == GGML_OP_FLASH_ATTN_EXT && ggml_kvq_fa_get_prerope(op, nullptr, nullptr, nullptr, nullptr)) {
        return true;
    }
    for (int i = 0; i < GGML_MAX_SRC; ++i) {
        if (op->src[i] && ggml_kvq_type_has_cuda(op->src[i]->type)) {
            return true;
        }
    }
    return false;
}

static bool kvq_rows_fit(const ggml_tensor * t) {
    return t->nb[0] == ggml_type_size(t->type) && t->ne[0] % ggml_blck_size(t->type) == 0;
}

int ggml_kvq_cuda_supports_op(const ggml_tensor * op, ggml_kvq_cuda_standin * standin) {
    if (!kvq_involved(op)) {
        return GGML_KVQ_CUDA_NOT_OURS;
    }
    const ggml_tensor * src0 = op->src[0];
    switch (op->op) {
        case GGML_OP_NONE:       // views of the cache: no kernel, upstream's answer
        case GGML_OP_VIEW:
        case GGML_OP_RESHAPE:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE:
            return GGML_KVQ_CUDA_NOT_OURS;
        case GGML_OP_SET_ROWS:
            return (ggml_kvq_type_has_cuda(op->type) || kvq_lsq_write(op)) && src0->type == GGML_TYPE_F32 && src0->nb[0] == sizeof(float) &&
                   (op->src[1]->type == GGML_TYPE_I64 || op->src[1]->type == GGML_TYPE_I32) &&
                   src0->ne[0] == op->ne[0] && kvq_rows_fit(op)
                ? GGML_KVQ_CUDA_YES : GGML_KVQ_CUDA_NO;
        case GGML_OP_CPY:
        case GGML_OP_DUP: {
            if (src0->type == op->type) {   // cache copies between sequences / cells: bytes as they are
                return ggml_is_contiguous(src0) && ggml_is_contiguous(op) && ggml_nbytes(src0) == ggml_nbytes(op)
                    ? GGML_KVQ_CUDA_YES : GGML_KVQ_CUDA_NO;
            }
            const bool quantize   = src0->type == GGML_TYPE_F32 && ggml_kvq_type_has_cuda(op->type);
            const bool dequantize = ggml_kvq_type_has_cuda(src0->type) && (op->type == GGML_TYPE_F32 || op->type == GGML_TYPE_F16);
            return (quantize || dequantize) && ggml_are_same_shape(src0, op) &&
                   src0->nb[0] == ggml_type_size(src0->type) && kvq_rows_fit(quantize ? op : src0) &&
                   op->nb[0] == ggml_type_size(op->type)
                ? GGML_KVQ_CUDA_YES : GGML_KVQ_CUDA_NO;
        }
        case GGML_OP_FLASH_ATTN_EXT: {
            const ggml_tensor * K = op->src[1];
            const ggml_tensor * V = op->src[2];
            if (!K || !V || src0->type != GGML_TYPE_F32 || !kvq_fa_prerope_supported(op) || !kvq_fa_window_supported(op)) {
                return GGML_KVQ_CUDA_NO;
            }
            for (const ggml_tensor * t : { K, V }) {
                if (ggml_kvq_type_has_cuda(t->type) ? !kvq_rows_fit(t) || t->ne[0] % 8 != 0 : !kvq_fa_stock_to_f16(t->type)) {
                    return GGML_KVQ_CUDA_NO;
                }
            }
            kvq_fattn_standin(op, standin);
            return GGML_KVQ_CUDA_AS_F16;
        }
        default:
            return GGML_KVQ_CUDA_NO;
    }
}

bool ggml_kvq_cuda_compute_forward(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (!kvq_involved(dst)) {
        return false;
    }
    switch (dst->op) {   // ggml-cuda skips views and no-ops before compute_forward
        case GGML_OP_SET_ROWS:       kvq_quantize_cuda(ctx, dst, dst->src[1]); return true;
        case GGML_OP_CPY:
        case GGML_OP_DUP:            kvq_cpy_cuda(ctx, dst);      return true;
        case GGML_OP_FLASH_ATTN_EXT: kvq_fattn_cuda(ctx, dst);    return true;
        default:
            GGML_ABORT("pykvq: %s on %s is not implemented on CUDA (supports_op declines it)",
                       ggml_op_name(dst->op), dst->name);
    }
}
