// pykvq: the element-wise kernels on the cache types (one thread per block of values), in a
// header so tests/test_cuda.py's host emulation can run them too (native/tests/cuda_emu).
#pragma once

#include "common.cuh"
#include "kvq-codec.cuh"
#include "kvq-prerope.cuh"

// a nuq codebook by value (kernel argument); zeros for the other types
struct kvq_cb {
    int8_t c[16];
};

// ---- quantize: SET_ROWS and CPY f32 -> type -------------------------------------------------

// one thread per block of qk values: row i01 of src0 goes to row src1[i01, i02 % ne11, i03 % ne12]
// of dst (SET_ROWS), or to row i01 when src1 is NULL (CPY f32 -> type, same shapes)
template <ggml_type T, typename idx_t>
static __global__ void kvq_quantize_rows(const char * src0, const char * src1, char * dst, const kvq_cb cb,
        const int64_t nblk, const int64_t ne01, const int64_t ne02, const int64_t total,
        const int64_t nb01, const int64_t nb02, const int64_t nb03,
        const int64_t ne11, const int64_t ne12, const int64_t nb10, const int64_t nb11, const int64_t nb12,
        const int64_t nb1, const int64_t nb2, const int64_t nb3) {
    constexpr int qk = kvq_traits<T>::qk;
    const int64_t i = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    if (i >= total) {
        return;
    }
    int64_t ib, i01, i02, i03;
    kvq_unravel(i, nblk, ne01, ne02, ib, i01, i02, i03);
    const int64_t row = src1 ? (int64_t) *(const idx_t *) (src1 + i01*nb10 + (i02 % ne11)*nb11 + (i03 % ne12)*nb12) : i01;

    float x[qk];
    const float * xs = (const float *) (src0 + i01*nb01 + i02*nb02 + i03*nb03) + ib*qk;
#pragma unroll
    for (int j = 0; j < qk; ++j) {
        x[j] = xs[j];
    }
    kvq_quantize_block<T>(x, (uint8_t *) (dst + row*nb1 + i02*nb2 + i03*nb3) + ib*kvq_traits<T>::bs, cb.c);
}

// ---- least-squares blocks, one warp each ----------------------------------------------------------

// kvq_lsq_block with its candidate scales spread over a warp: lane k tries scale k with the same arithmetic in the
// same order, the first of the smallest errors wins as in the serial loop, so the bytes are the reference's. One
// thread per block ran the 26 x 32 search serially: the slowest kernel of a converted file's decode step.
// xs: the 32 values in shared memory; es: 32 doubles of the warp's shared scratch; lane 0 writes the scale's bytes
// to d_out; returns lane j's level of value j
static __device__ __forceinline__ uint8_t kvq_lsq_block_warp(const float * xs, const int half, uint8_t * d_out,
                                                             double * es, const int lane) {
    static_assert(GGML_KVQ_LSQ_N == WARP_SIZE && GGML_KVQ_LSQ_N_SCALES <= WARP_SIZE, "one value and at most one scale per lane");
    const float base = kvq_div_rn(kvq_lsq_vmax(xs), (float) -half);   // every lane the same scan (broadcast reads)
    if (lane < GGML_KVQ_LSQ_N_SCALES) {
        es[lane] = kvq_lsq_error(xs, half, kvq_lsq_d(base, lane));
    }
    __syncwarp();
    int    kb   = 0;
    double best = es[0];
    for (int k = 1; k < GGML_KVQ_LSQ_N_SCALES; ++k) {
        if (es[k] < best) {
            best = es[k];
            kb   = k;
        }
    }
    __syncwarp();   // es is the next search's
    const float d = kvq_lsq_d(base, kb);
    if (lane == 0) {
        kvq_put_f16(d_out, d);
    }
    return (uint8_t) kvq_lsq_level(kvq_lsq_value(xs[lane]), kvq_lsq_inv(d), half);
}

#define KVQ_LSQ_WARPS 4   // warps (blocks of values) per CUDA block of kvq_quantize_rows_lsq

// kvq_quantize_rows for the least-squares types (kvq_is_lsq), one warp per block of values: blockDim (32, KVQ_LSQ_WARPS)
template <ggml_type T, typename idx_t>
static __global__ void kvq_quantize_rows_lsq(const char * src0, const char * src1, char * dst,
        const int64_t nblk, const int64_t ne01, const int64_t ne02, const int64_t total,
        const int64_t nb01, const int64_t nb02, const int64_t nb03,
        const int64_t ne11, const int64_t ne12, const int64_t nb10, const int64_t nb11, const int64_t nb12,
        const int64_t nb1, const int64_t nb2, const int64_t nb3) {
    constexpr int qk = kvq_traits<T>::qk;
    static_assert(kvq_is_lsq<T>() && (qk == 32 || qk == 64), "a least-squares type");
    __shared__ float   sx[KVQ_LSQ_WARPS][64];
    __shared__ double  se[KVQ_LSQ_WARPS][WARP_SIZE];
    __shared__ uint8_t sq[KVQ_LSQ_WARPS][64];
    const int     lane = threadIdx.x;
    const int     w    = threadIdx.y;
    const int64_t i    = (int64_t) blockIdx.x*KVQ_LSQ_WARPS + w;
    if (i >= total) {   // the whole warp
        return;
    }
    int64_t ib, i01, i02, i03;
    kvq_unravel(i, nblk, ne01, ne02, ib, i01, i02, i03);
    const int64_t row = src1 ? (int64_t) *(const idx_t *) (src1 + i01*nb10 + (i02 % ne11)*nb11 + (i03 % ne12)*nb12) : i01;
    const float * xs = (const float *) (src0 + i01*nb01 + i02*nb02 + i03*nb03) + ib*qk;
    for (int j = lane; j < qk; j += WARP_SIZE) {
        sx[w][j] = xs[j];
    }
    __syncwarp();
    uint8_t * y = (uint8_t *) (dst + row*nb1 + i02*nb2 + i03*nb3) + ib*kvq_traits<T>::bs;
    sq[w][lane] = kvq_lsq_block_warp(sx[w], kvq_lsq_half_a<T>(), y, se[w], lane);
    if constexpr (qk == 64) {
        sq[w][32 + lane] = kvq_lsq_block_warp(sx[w] + 32, kvq_lsq_half_b<T>(), y + 2, se[w], lane);
    }
    __syncwarp();
    if (lane == 0) {
        kvq_lsq_pack<T>(sq[w], sq[w] + 32, y);
    }
}

// ---- dequantize: CPY type -> f32 / f16, and K / V to f16 for the prefill path ---------------------

template <ggml_type T, typename dst_t>
static __global__ void kvq_dequant(const char * src0, dst_t * dst, const kvq_cb cb,
        const int64_t nchunk, const int64_t ne1, const int64_t ne2, const int64_t total,
        const int64_t nb01, const int64_t nb02, const int64_t nb03,
        const int64_t nb1, const int64_t nb2, const int64_t nb3) {
    constexpr int N = 8;   // divides every block size
    __shared__ float c[16];
    if (threadIdx.x < 16) {
        c[threadIdx.x] = (float) cb.c[threadIdx.x];
    }
    __syncthreads();
    const int64_t i = (int64_t) blockIdx.x*blockDim.x + threadIdx.x;
    if (i >= total) {
        return;
    }
    int64_t ic, i1, i2, i3;
    kvq_unravel(i, nchunk, ne1, ne2, ic, i1, i2, i3);
    float v[N];
    kvq_dequantize<T, N>((const uint8_t *) (src0 + i1*nb01 + i2*nb02 + i3*nb03), (int) (ic*N), c, v);
    dst_t * y = (dst_t *) ((char *) dst + i1*nb1 + i2*nb2 + i3*nb3) + ic*N;
#pragma unroll
    for (int l = 0; l < N; ++l) {
        y[l] = ggml_cuda_cast<dst_t>(v[l]);
    }
}

// ---- pre-RoPE K -> post-RoPE f16 (the prefill path's stand-in K) ----------------------------

// K [D, n_kv, n_head_kv, n_stream] of type T (strides nb1..nb3) -> the post-RoPE keys
// as contiguous f16, one warp per row. src may be dst's memory (f16 rows converted in place:
// a warp reads its whole row before writing it).
template <int D, ggml_type T>
static __global__ void kvq_prerope_k_to_f16(const char * src, half * dst, const kvq_prerope_args p, const kvq_cb cb,
                                            const int n_kv, const int n_head_kv, const int64_t n_rows,
                                            const int64_t nb1, const int64_t nb2, const int64_t nb3) {
    constexpr int EPL = D / WARP_SIZE;
    const int lane = threadIdx.x;
    __shared__ float c[16];
    const int tid = threadIdx.y*WARP_SIZE + lane;
    if (tid < 16) {
        c[tid] = (float) cb.c[tid];
    }
    __syncthreads();
    const int64_t row = (int64_t) blockIdx.x*blockDim.y + threadIdx.y;
    if (row >= n_rows) {
        return;   // the whole warp: rows are per warp
    }
    const int j   = (int) (row % n_kv);
    const int kvh = (int) ((row / n_kv) % n_head_kv);
    const int s   = (int) (row / ((int64_t) n_kv*n_head_kv));
    kvq_prerope_lane<EPL> L;
    kvq_prerope_lane_init<EPL>(L, p, kvh, D, lane);
    float x[EPL];
    const char * r = src + j*nb1 + kvh*nb2 + s*nb3;
    if constexpr (T == GGML_TYPE_F16) {
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            x[e] = __half2float(((const half *) r)[lane*EPL + e]);
        }
    } else {
        kvq_dequantize<T, EPL>((const uint8_t *) r, lane*EPL, c, x);
    }
    kvq_prerope_row<EPL>(x, p.pos[s*p.pos_stride + j], L, p);
    __syncwarp();   // in place: every lane has read its values before any is written
    half * o = dst + row*D + lane*EPL;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
        o[e] = ggml_cuda_cast<half>(x[e]);
    }
}
