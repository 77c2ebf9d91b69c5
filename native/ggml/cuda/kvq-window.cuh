// pykvq: the exact window of a pre-RoPE cache (ggml-kvq.h, ggml_kvq_fa_set_window) on CUDA.
//
// src[9] holds f16 or q8_0 rows [K of every KV head | V of every KV head] in the cache's own domain (q8_0: every
// head starts on a block); plane 1 of
// the positions input gives each cell's row (-1, or a row past src[9]'s: the quantized cell), plane 2
// the last query position that reads it, plane 3 each query's position (absent: every query reads
// every row). A query reads a cell's exact row instead of its quantized one when both planes say so.
//
// Decode (kvq-fattn.cuh) asks kvq_window_row per key. Prefill hands upstream's f16 flash attention
// K and V with the window's rows appended after the cache's cells (K turned at the position of the
// cell that names the row) and a mask that, per query, hides a cell whose exact row that query reads
// and shows the row in its place (with the cell's own mask value): the same softmax, query by query,
// as the CPU kernel's. A row is shown for one cell of a stream (kvq_win_inverse keeps the largest);
// a cell whose row another cell claimed is read quantized.
#pragma once

#include "kvq-codec.cuh"

struct kvq_window_args {
    const char    * rows;   // src[9]; NULL: no window
    const int32_t * row;    // plane 1 (streams pos_stride apart, like the positions)
    const int32_t * last;   // plane 2, or NULL: every query reads every row
    const int32_t * qpos;   // plane 3
    int64_t nb1;            // bytes between rows
    int64_t v0;             // where V starts in a row (elements)
    int     n;              // rows
    bool    q8;             // rows in q8_0 (else f16)
};

// the bytes before element e of a window row (e on a block boundary for q8_0 rows)
KVQ_HD int64_t kvq_window_offset(const kvq_window_args & w, const int64_t e) {
    return w.q8 ? e/32*34 : e*(int64_t) sizeof(half);
}

// one query's view of the window
struct kvq_window_query {
    bool            on;
    const int32_t * row;
    const int32_t * last;
    int32_t         qpos;
};

static __device__ __forceinline__ kvq_window_query kvq_window_query_of(const kvq_window_args & w, const int64_t stride,
                                                                      const int s, const int j) {
    kvq_window_query q = {};
    q.on = w.rows != nullptr;
    if (q.on) {
        q.row  = w.row + s*stride;
        q.last = w.last ? w.last + s*stride : nullptr;
        q.qpos = w.last ? w.qpos[s*stride + j] : 0;
    }
    return q;
}

// the exact row the query reads for cell c, or -1
static __device__ __forceinline__ int kvq_window_row(const kvq_window_args & w, const kvq_window_query & q, const int c) {
    const int r = q.row[c];
    return r >= 0 && r < w.n && (q.last == nullptr || q.qpos <= q.last[c]) ? r : -1;
}

// a half from its bits (-inf, 0) without convert.cuh, also under the host emulation
static __device__ __forceinline__ half kvq_half_bits(const uint16_t b) {
#ifdef __CUDACC__
    return __ushort_as_half(b);
#else
    return half{ b };
#endif
}

// ---- prefill: the rows appended to upstream's K / V, and the mask over both ------------------

// inv[s][r]: the cell of stream s that names row r (the largest, when several do), else -1 (inv preset to -1)
static __global__ void kvq_win_inverse(const kvq_window_args w, const int64_t stride, const int n_kv, const int n_stream,
                                       int32_t * inv) {
    const int64_t i = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    if (i >= (int64_t) n_kv*n_stream) {
        return;
    }
    const int c = (int) (i % n_kv);
    const int s = (int) (i / n_kv);
    const int r = w.row[s*stride + c];
    if (r >= 0 && r < w.n) {
        atomicMax(inv + (int64_t) s*w.n + r, c);
    }
}

// pos_w[s][r]: the position of the cell that names row r (0 for a row no cell names: masked anyway)
static __global__ void kvq_win_positions(const int32_t * inv, const int32_t * pos, const int64_t stride, const int n_w,
                                         const int n_stream, int32_t * pos_w) {
    const int64_t i = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    if (i >= (int64_t) n_w*n_stream) {
        return;
    }
    const int s = (int) (i / n_w);
    const int x = inv[i];
    pos_w[i] = x >= 0 ? pos[s*stride + x] : 0;
}

// the stand-in's mask [n_all, n_qpad, ne2, n_stream] (f16, contiguous) from the node's (nb: its byte strides;
// stream s reads mask stream s % ne3): cells 0 .. n_kv-1, then the n_w rows, then padding (-inf). Query j < n_q
// reads cell c's row r when kvq_window_row says so and r is c's in inv; rows beyond n_q (padding) as the node's.
static __global__ void kvq_win_mask(const char * mask, const int64_t nb1, const int64_t nb2, const int64_t nb3,
                                    const int ne3, const kvq_window_args w, const int64_t stride, const int32_t * inv,
                                    const int n_kv, const int n_all, const int n_q, const int n_qpad, const int ne2,
                                    const int n_stream, half * out) {
    const int64_t i = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    if (i >= (int64_t) n_all*n_qpad*ne2*n_stream) {
        return;
    }
    int64_t c, j, h, s;
    kvq_unravel(i, n_all, n_qpad, ne2, c, j, h, s);
    const half * mrow = (const half *) (mask + j*nb1 + h*nb2 + (s % ne3)*nb3);
    const half ninf = kvq_half_bits(0xFC00);
    const int  n_w  = w.n;
    if (c >= n_kv + n_w) {
        out[i] = ninf;
        return;
    }
    if (j >= n_q) {
        out[i] = c < n_kv ? mrow[c] : ninf;
        return;
    }
    const kvq_window_query q = kvq_window_query_of(w, stride, s, j);
    if (c < n_kv) {
        const int r = kvq_window_row(w, q, c);
        out[i] = r >= 0 && inv[(int64_t) s*n_w + r] == c ? ninf : mrow[c];
    } else {
        const int x = inv[(int64_t) s*n_w + (c - n_kv)];
        out[i] = x >= 0 && kvq_window_row(w, q, x) == c - n_kv ? mrow[x] : ninf;
    }
}

// dst [D, n_all, n_head, n_stream] (f16, contiguous): rows 0 .. n_kv-1 from src, then n_w rows from wsrc, then
// zeros; src f16, wsrc f16 or (wq8) q8_0 rows of D values, both at byte strides (a 0 stride: the same rows for every
// head / stream)
static __global__ void kvq_win_assemble(const char * src, const int64_t nb1, const int64_t nb2, const int64_t nb3,
                                        const char * wsrc, const int64_t wnb1, const int64_t wnb2, const int64_t wnb3,
                                        const bool wq8, const int D, const int n_kv, const int n_w, const int n_all,
                                        const int n_head, const int n_stream, half * dst) {
    const int64_t i = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    if (i >= (int64_t) D*n_all*n_head*n_stream) {
        return;
    }
    int64_t d, c, h, s;
    kvq_unravel(i, D, n_all, n_head, d, c, h, s);
    if (c < n_kv) {
        dst[i] = ((const half *) (src + c*nb1 + h*nb2 + s*nb3))[d];
    } else if (c < n_kv + n_w) {
        const char * row = wsrc + (c - n_kv)*wnb1 + h*wnb2 + s*wnb3;
        if (wq8) {   // rounded to f16 once: upstream's f16 kernel reads them, as it reads the cache's own V
            float f;
            kvq_dequantize<GGML_TYPE_Q8_0, 1>((const uint8_t *) row, (int) d, nullptr, &f);
            dst[i] = kvq_half_bits(ggml_kvq_fp32_to_fp16(f));
        } else {
            dst[i] = ((const half *) row)[d];
        }
    } else {
        dst[i] = kvq_half_bits(0);
    }
}
