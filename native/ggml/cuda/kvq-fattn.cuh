// pykvq: flash-attention decode (one query token) straight from the quantized cache.
//
// One block per (KV head, group of G = 4 or 8 query heads, KV split, sequence; G = 4 where the GQA
// group has at most 4, for fewer registers): every K and V row is read and decoded once for all
// query heads of its block (upstream's vec kernel reads it once per query head). 4 warps; a warp
// takes tiles of 32 keys: the K·Q dot of each key is spread over the 32 lanes (D/32 values each,
// f32), the G heads' sums reduced together by a halving butterfly (9 shuffles for 8), the scores
// parked in shared memory so that lane i takes key i: the tile's softmax needs one exp per lane and head, and the V rows are accumulated
// with the probabilities read back from shared memory as broadcasts. The warps, then the splits, are
// merged with the usual (max, sum) rescaling; attention sinks enter at the split merge.
// Codebooks (nuq K / V) come in the kernel arguments, so CUDA graphs replay them as they are.
// PRE: a pre-RoPE K cache; each decoded K row is turned into its post-RoPE key (kvq-prerope.cuh)
// once per warp, i.e. once for the block's whole GQA group, before the K·Q dots.
// WINDOW (PRE only; ggml_kvq_fa_set_window): cells whose exact row the query still reads take that f16 / q8_0 row
// (the same pre-RoPE domain, so the same transform follows) instead of their quantized one; a tile asks once,
// lane i for key i, and a tile without such a cell (nearly all of them) reads as before.
#pragma once

#include "common.cuh"
#include "kvq-codec.cuh"
#include "kvq-prerope.cuh"
#include "kvq-window.cuh"

#define KVQ_FA_NWARPS 4
#define KVQ_FA_G      8      // query heads per block at most (kvq_fa_reduce_heads: 4 or 8; 4 where the GQA group has <= 4)

struct kvq_fattn_args {
    const char  * Q;
    const char  * K;
    const char  * V;
    const char  * mask;     // f16 or NULL
    float       * part;     // [seq][head][split][D]
    float2      * meta;     // [seq][head][split]: (max, sum)
    float    scale;         // divided by softcap when softcap != 0 (like upstream)
    float    softcap;
    float    max_bias, m0, m1;
    uint32_t n_head_log2;
    int      ne02;          // query heads
    int      ne11;          // KV length
    int      gqa;           // query heads per KV head
    int      n_split;
    int      kv_per_split;  // a multiple of 32*KVQ_FA_NWARPS
    int      ne32, ne33;
    int64_t  nb02, nb03;
    int64_t  nb11, nb12, nb13;
    int64_t  nb21, nb22, nb23;
    int64_t  nb32, nb33;
    int8_t   cb_k[16];
    int8_t   cb_v[16];
    kvq_prerope_args pre;   // PRE kernels only
    kvq_window_args  win;   // PRE kernels only; win.rows NULL: no exact window
};

// N consecutive values of a row; f16 rows by half2 loads, the rest through the codec
template <ggml_type T, int N>
static __device__ __forceinline__ void kvq_fa_load(const char * row, int i0, const float * c, float * out) {
    if constexpr (T == GGML_TYPE_F16) {
        const half2 * p = (const half2 *) row + i0/2;
#pragma unroll
        for (int l = 0; l < N/2; ++l) {
            const float2 f = __half22float2(p[l]);
            out[2*l + 0] = f.x;
            out[2*l + 1] = f.y;
        }
    } else if constexpr (T == GGML_TYPE_Q4_0) {
        // upstream's block (a pre-RoPE cache of stock q4_0 comes here): f16 d, then value j in the
        // low nibble of byte j (j < 16) or the high nibble of byte j - 16
        static_assert(16 % N == 0, "a lane's values lie in one half of a block");
        const uint8_t * b  = (const uint8_t *) row + (i0/32)*18;
        const float     d  = kvq_f16_bytes(b);
        const int       j  = i0 % 32;
        const int       sh = j < 16 ? 0 : 4;
#pragma unroll
        for (int l = 0; l < N; ++l) {
            out[l] = d*(float) (((b[2 + j%16 + l] >> sh) & 0x0F) - 8);
        }
    } else {
        kvq_dequantize<T, N>((const uint8_t *) row, i0, c, out);
    }
}

// the lane's N values of rows k .. k+U-1 (those below nk) of a tile, all issued before any is
// used so that their memory latencies overlap
template <ggml_type T, int U, int N>
static __device__ __forceinline__ void kvq_fa_load_rows(const char * base, int64_t nb, int k, int nk, int i0,
                                                       const float * c, float (&out)[U][N]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u < nk) {
            kvq_fa_load<T, N>(base + (int64_t) (k + u)*nb, i0, c, out[u]);
        }
    }
}

// rows k .. k+U-1 of a tile (i0 = k - the tile's first) whose exact-window row lane (i0 + u) holds in wr
// (-1: none) replaced by that row's values at element offset off; warp-uniform (shuffles)
template <int U, int N>
static __device__ __forceinline__ void kvq_fa_load_window_rows(const kvq_window_args & w, const int wr, const int i0,
                                                               const int nk, const int64_t off, const int c0,
                                                               float (&out)[U][N]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int r = __shfl_sync(0xFFFFFFFF, wr, (i0 + u) & (WARP_SIZE - 1), WARP_SIZE);
        if (i0 + u < nk && r >= 0) {
            const char * row = w.rows + (int64_t) r*w.nb1 + kvq_window_offset(w, off);
            if (w.q8) {
                kvq_fa_load<GGML_TYPE_Q8_0, N>(row, c0, nullptr, out[u]);
            } else {
                kvq_fa_load<GGML_TYPE_F16, N>(row, c0, nullptr, out[u]);
            }
        }
    }
}

// the G sums of every lane reduced over the warp together: each butterfly step halves the values a lane keeps
// (G/2 + ... + 1 shuffles, then one per lane bit left: 9 for G = 8 instead of 8 x 5); lane l ends with the sum of
// head l / (32/G)
template <int G>
static __device__ __forceinline__ float kvq_fa_reduce_heads(const float (&v)[G], const int lane) {
    static_assert((G == 4 || G == 8) && WARP_SIZE == 32, "the K·Q butterfly reduces 4 or 8 heads over 32 lanes");
    float v2[2];
    if constexpr (G == 8) {
        float v4[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const bool hi = lane & 16;
            v4[j] = (hi ? v[j + 4] : v[j]) + __shfl_xor_sync(0xFFFFFFFF, hi ? v[j] : v[j + 4], 16, WARP_SIZE);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const bool hi = lane & 8;
            v2[j] = (hi ? v4[j + 2] : v4[j]) + __shfl_xor_sync(0xFFFFFFFF, hi ? v4[j] : v4[j + 2], 8, WARP_SIZE);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const bool hi = lane & 16;
            v2[j] = (hi ? v[j + 2] : v[j]) + __shfl_xor_sync(0xFFFFFFFF, hi ? v[j] : v[j + 2], 16, WARP_SIZE);
        }
    }
    constexpr int o1 = G == 8 ? 4 : 8;   // the last halving step's lane bit
    const bool hi = lane & o1;
    float v1 = (hi ? v2[1] : v2[0]) + __shfl_xor_sync(0xFFFFFFFF, hi ? v2[0] : v2[1], o1, WARP_SIZE);
#pragma unroll
    for (int o = o1/2; o >= 1; o /= 2) {
        v1 += __shfl_xor_sync(0xFFFFFFFF, v1, o, WARP_SIZE);
    }
    return v1;
}

template <int D, ggml_type TK, ggml_type TV, bool PRE, int G>
__launch_bounds__(WARP_SIZE*KVQ_FA_NWARPS, 2)
static __global__ void kvq_fattn_vec(const kvq_fattn_args a) {
    constexpr int NW  = KVQ_FA_NWARPS;
    constexpr int EPL = D / WARP_SIZE;     // values per lane
    constexpr int U   = EPL >= 8 ? 2 : 8;  // K / V rows in flight per lane (registers: U*EPL)
    static_assert(D % (2*WARP_SIZE) == 0, "D must be a multiple of 64");

    const int lane  = threadIdx.x;
    const int warp  = threadIdx.y;
    const int seq   = blockIdx.z;
    const int split = blockIdx.y;
    const int n_hb  = (a.gqa + G - 1) / G;
    const int kvh   = blockIdx.x / n_hb;
    const int h0    = kvh*a.gqa + (blockIdx.x % n_hb)*G;
    const int ng    = min(G, (kvh + 1)*a.gqa - h0);

    __shared__ float cbk[16];
    __shared__ float cbv[16];
    const int tid = warp*WARP_SIZE + lane;
    if (tid < 16) {
        cbk[tid] = (float) a.cb_k[tid];
        cbv[tid] = (float) a.cb_v[tid];
    }

    // the heads' ALiBi slopes in shared memory and their mask rows as offsets from one base: registers are what
    // limits this kernel's blocks per SM (ptxas: 135-255 per thread), and these are read once per tile
    __shared__ float sh_slope[G];
    if (tid < G) {
        const int h = h0 + (tid < ng ? tid : 0);
        float sl = 1.0f;
        if (a.max_bias > 0.0f) {
            const float base = (uint32_t) h < a.n_head_log2 ? a.m0 : a.m1;
            const int   exph = (uint32_t) h < a.n_head_log2 ? h + 1 : 2*(h - (int) a.n_head_log2) + 1;
            sl = powf(base, exph);
        }
        sh_slope[tid] = sl;
    }
    const char * mbase = a.mask ? a.mask + (seq % a.ne33)*a.nb33 : nullptr;

    float q[G][EPL];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int h = h0 + (g < ng ? g : 0);
        const float * qp = (const float *) (a.Q + seq*a.nb03 + h*a.nb02) + lane*EPL;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            q[g][e] = g < ng ? qp[e]*a.scale : 0.0f;
        }
    }
    __syncthreads();

    const char * K = a.K + seq*a.nb13 + kvh*a.nb12;
    kvq_prerope_lane<EPL> pl;
    const int32_t * kpos = nullptr;
    if constexpr (PRE) {
        kvq_prerope_lane_init<EPL>(pl, a.pre, kvh, D, lane);
        kpos = a.pre.pos + seq*a.pre.pos_stride;
    }
    const char * V = a.V + seq*a.nb23 + kvh*a.nb22;
    kvq_window_query wq = {};
    if constexpr (PRE) {
        wq = kvq_window_query_of(a.win, a.pre.pos_stride, seq, 0);
    }

    __shared__ float sh_s[NW][G][WARP_SIZE];   // a tile's scores: [head][key]
    __shared__ float sh_p[NW][WARP_SIZE][G];   // its probabilities: [key][head]

    float M[G], S[G], acc[G][EPL];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        M[g] = -FLT_MAX/2.0f;
        S[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            acc[g][e] = 0.0f;
        }
    }

    const int kb = split*a.kv_per_split;
    const int ke = min(a.ne11, kb + a.kv_per_split);

    for (int k0 = kb + warp*WARP_SIZE; k0 < ke; k0 += NW*WARP_SIZE) {
        const int nk = min(WARP_SIZE, ke - k0);
        // the exact window: lane i's key's row of it (-1: the quantized one), and whether any key of the tile has one
        int  wr   = -1;
        bool wany = false;
        if constexpr (PRE) {
            if (wq.on) {
                wr   = lane < nk ? kvq_window_row(a.win, wq, k0 + lane) : -1;
                wany = __ballot_sync(0xFFFFFFFF, wr >= 0) != 0;
            }
        }

        // K·Q of the tile's keys -> sh_s[warp][g][key], U rows at a time
        for (int i0 = 0; i0 < nk; i0 += U) {
          float kf[U][EPL];
          kvq_fa_load_rows<TK, U, EPL>(K, a.nb11, k0 + i0, nk - i0, lane*EPL, cbk, kf);
          if constexpr (PRE) {
              if (wany) {
                  kvq_fa_load_window_rows<U, EPL>(a.win, wr, i0, nk, (int64_t) kvh*D, lane*EPL, kf);
              }
#pragma unroll
              for (int u = 0; u < U; ++u) {
                  if (i0 + u < nk) {   // warp-uniform: the shuffles inside see the whole warp
                      kvq_prerope_row<EPL>(kf[u], kpos[k0 + i0 + u], pl, a.pre);
                  }
              }
          }
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int i = i0 + u;
            if (i >= nk) {
                break;
            }
            float v[G];
#pragma unroll
            for (int g = 0; g < G; ++g) {
                v[g] = 0.0f;
#pragma unroll
                for (int e = 0; e < EPL; ++e) {
                    v[g] += q[g][e]*kf[u][e];
                }
            }
            if (ng > 2) {
                const float v1 = kvq_fa_reduce_heads<G>(v, lane);
                if ((lane & (WARP_SIZE/G - 1)) == 0) {
                    sh_s[warp][(lane / (WARP_SIZE/G)) & (G - 1)][i] = v1;
                }
            } else {
#pragma unroll
                for (int g = 0; g < 2; ++g) {
                    if (g < ng) {
                        const float sg = warp_reduce_sum(v[g]);
                        if (lane == 0) {
                            sh_s[warp][g][i] = sg;
                        }
                    }
                }
            }
          }
        }
        __syncwarp();
        float sc[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            sc[g] = g < ng && lane < nk ? sh_s[warp][g][lane] : -INFINITY;
        }
        float p[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g < ng) {
                float s = sc[g];
                if (lane < nk) {
                    if (a.softcap != 0.0f) {
                        s = a.softcap*tanhf(s);
                    }
                    if (mbase) {
                        const half * mrow = (const half *) (mbase + ((h0 + g) % a.ne32)*a.nb32);
                        s += sh_slope[g]*__half2float(mrow[k0 + lane]);
                    }
                }
                const float mt = warp_reduce_max(s);
                const float Mn = fmaxf(M[g], mt);
                const float c  = expf(M[g] - Mn);
                p[g] = expf(s - Mn);
                S[g] = S[g]*c + p[g];
                sh_p[warp][lane][g] = p[g];
                M[g] = Mn;
#pragma unroll
                for (int e = 0; e < EPL; ++e) {
                    acc[g][e] *= c;
                }
            }
        }

        __syncwarp();
        for (int i0 = 0; i0 < nk; i0 += U) {
            float vf[U][EPL];
            kvq_fa_load_rows<TV, U, EPL>(V, a.nb21, k0 + i0, nk - i0, lane*EPL, cbv, vf);
            if constexpr (PRE) {
                if (wany) {
                    kvq_fa_load_window_rows<U, EPL>(a.win, wr, i0, nk, a.win.v0 + (int64_t) kvh*D, lane*EPL, vf);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (i0 + u >= nk) {
                    break;
                }
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    if (g < ng) {
                        const float pi = sh_p[warp][i0 + u][g];   // the same address for every lane: a broadcast
#pragma unroll
                        for (int e = 0; e < EPL; ++e) {
                            acc[g][e] += pi*vf[u][e];
                        }
                    }
                }
            }
        }
        __syncwarp();   // sh_s / sh_p are rewritten by the next tile
    }

    // merge the warps
    __shared__ float sh_acc[NW][G][D];
    __shared__ float sh_M[NW][G];
    __shared__ float sh_S[NW][G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float s = warp_reduce_sum(S[g]);
        if (lane == 0) {
            sh_M[warp][g] = M[g];
            sh_S[warp][g] = s;
        }
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            sh_acc[warp][g][lane*EPL + e] = acc[g][e];
        }
    }
    __syncthreads();

    for (int j = tid; j < ng*D; j += NW*WARP_SIZE) {
        const int g = j / D;
        const int d = j % D;
        float mx = sh_M[0][g];
#pragma unroll
        for (int w = 1; w < NW; ++w) {
            mx = fmaxf(mx, sh_M[w][g]);
        }
        float num = 0.0f;
        float den = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float f = expf(sh_M[w][g] - mx);
            num += f*sh_acc[w][g][d];
            den += f*sh_S[w][g];
        }
        const int64_t r = ((int64_t) seq*a.ne02 + h0 + g)*a.n_split + split;
        a.part[r*D + d] = num;
        if (d == 0) {
            a.meta[r] = make_float2(mx, den);
        }
    }
}

// dst[seq][head][D] from the splits; sinks (f32 per head) or NULL. D threads (D/32 warps): the splits' max and weights are
// found by all threads together (a stride of splits each, then block reductions) and kept in shared memory, so
// thread d's sum over the splits issues independent loads. One thread walking every split three times, each
// step waiting on the last load, took 17 us at 64 splits (H200, ncu, 2026-11-28: 25 cycles per instruction).
#define KVQ_FA_MAX_SPLIT 512    // the launch caps n_split here (the weights' shared memory)

template <int D>
static __global__ void kvq_fattn_combine(const float * part, const float2 * meta, const float * sinks,
                                         float * dst, const int ne02, const int n_split) {
    static_assert(D % WARP_SIZE == 0, "a whole number of warps");
    constexpr int NW = D / WARP_SIZE;
    const int h    = blockIdx.x;
    const int seq  = blockIdx.y;
    const int lane = threadIdx.x;          // blockDim (WARP_SIZE, D/WARP_SIZE)
    const int warp = threadIdx.y;
    const int tid  = warp*WARP_SIZE + lane;
    const int64_t r0 = ((int64_t) seq*ne02 + h)*n_split;
    __shared__ float sh_f[KVQ_FA_MAX_SPLIT];   // each split's weight exp(max_s - max)
    __shared__ float sh_red[NW];

    float mx = sinks ? sinks[h] : -FLT_MAX/2.0f;
    for (int s = tid; s < n_split; s += D) {
        mx = fmaxf(mx, meta[r0 + s].x);
    }
    mx = warp_reduce_max(mx);
    if (lane == 0) {
        sh_red[warp] = mx;
    }
    __syncthreads();
    mx = sh_red[0];
#pragma unroll
    for (int w = 1; w < NW; ++w) {
        mx = fmaxf(mx, sh_red[w]);
    }
    __syncthreads();   // sh_red takes the sums next

    float den = 0.0f;
    for (int s = tid; s < n_split; s += D) {
        const float2 m = meta[r0 + s];
        const float  f = expf(m.x - mx);
        sh_f[s] = f;
        den += f*m.y;
    }
    den = warp_reduce_sum(den);
    if (lane == 0) {
        sh_red[warp] = den;
    }
    __syncthreads();
    den = sinks ? expf(sinks[h] - mx) : 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
        den += sh_red[w];
    }
    const float inv = den == 0.0f ? 0.0f : 1.0f/den;

    float num0 = 0.0f, num1 = 0.0f;   // two chains of adds; the loads are independent
    int s = 0;
#pragma unroll 4
    for (; s + 1 < n_split; s += 2) {
        num0 += sh_f[s + 0]*part[(r0 + s + 0)*D + tid];
        num1 += sh_f[s + 1]*part[(r0 + s + 1)*D + tid];
    }
    if (s < n_split) {
        num0 += sh_f[s]*part[(r0 + s)*D + tid];
    }
    dst[((int64_t) seq*ne02 + h)*D + tid] = (num0 + num1)*inv;
}

// query heads per block: 4 for GQA groups of up to 4 (half the q / acc registers of 8, so more blocks per SM:
// ptxas puts head 64's kernels at a median 128 registers instead of 162), else 8
static inline int kvq_fattn_vec_g(const int gqa) {
    return gqa <= 4 ? 4 : KVQ_FA_G;
}

// The launch plan: splits (a.n_split, a.kv_per_split) for blocks of kvq_fattn_vec_g's heads (the GQA group's, so
// each K / V row is read once for the group): enough blocks for 4 per SM where the cache has the tiles (a warp takes
// tiles of 32 keys). One head per block (as upstream's kernel) was tried on an H200 (2026-11-28): 10% faster at 256
// cells but 35% slower at 8k (SmolLM2's head 64) and 4x slower for Qwen's pre-RoPE keys at 32k (each head turns
// every key again), so the group stays; docs/RESULTS-BY-DATE.md.
static inline void kvq_fattn_vec_plan(kvq_fattn_args & a, const int n_kv_heads, const int n_seq, const int n_sm) {
    const int step      = WARP_SIZE*KVQ_FA_NWARPS;
    const int max_split = std::max(1, std::min((a.ne11 + step - 1)/step, KVQ_FA_MAX_SPLIT));
    const int g         = kvq_fattn_vec_g(a.gqa);
    const int blocks    = n_kv_heads*((a.gqa + g - 1)/g)*n_seq;
    const int n_split   = std::max(1, std::min((4*n_sm + blocks - 1)/blocks, max_split));
    a.kv_per_split = ((a.ne11 + n_split - 1)/n_split + step - 1)/step*step;
    a.n_split      = std::max(1, (a.ne11 + a.kv_per_split - 1)/a.kv_per_split);
}

#ifdef __CUDACC__   // launches (the kernels above also build for tests/test_cuda.py's host emulator)
template <int D, ggml_type TK, ggml_type TV, bool PRE>
static void kvq_fattn_vec_launch(const kvq_fattn_args & a, const int n_kv_heads, const int n_seq, cudaStream_t stream) {
    const int  G = kvq_fattn_vec_g(a.gqa);
    const dim3 grid(n_kv_heads*((a.gqa + G - 1)/G), a.n_split, n_seq);
    const dim3 block(WARP_SIZE, KVQ_FA_NWARPS, 1);
    if (G == 4) {
        kvq_fattn_vec<D, TK, TV, PRE, 4><<<grid, block, 0, stream>>>(a);
    } else {
        kvq_fattn_vec<D, TK, TV, PRE, KVQ_FA_G><<<grid, block, 0, stream>>>(a);
    }
    CUDA_CHECK(cudaGetLastError());
}

// a pre-RoPE K cache has decode kernels for quantized K (an f16 one exists only for equivalence
// tests, PYKVQ_K_DOMAIN=pre, and takes the prefill path)
static constexpr bool kvq_fattn_vec_pre_ok(ggml_type tk) {
    return tk != GGML_TYPE_F16;
}

template <int D, ggml_type TK, ggml_type TV>
static bool kvq_fattn_vec_run(const kvq_fattn_args & a, bool pre, int n_kv_heads, int n_seq, cudaStream_t stream) {
    if (pre) {
        if constexpr (kvq_fattn_vec_pre_ok(TK)) {
            kvq_fattn_vec_launch<D, TK, TV, true>(a, n_kv_heads, n_seq, stream);
            return true;
        }
        return false;
    }
    kvq_fattn_vec_launch<D, TK, TV, false>(a, n_kv_heads, n_seq, stream);
    return true;
}

// The decode kernels compiled for head size D (kvq-fattn-d<D>.cu): runs the combination
// and returns true, or returns false when (K type, V type, pre-RoPE K) is not compiled.
bool kvq_fattn_vec_d64 (const kvq_fattn_args & a, ggml_type tk, ggml_type tv, bool pre, int n_kv_heads, int n_seq, cudaStream_t stream);
bool kvq_fattn_vec_d128(const kvq_fattn_args & a, ggml_type tk, ggml_type tv, bool pre, int n_kv_heads, int n_seq, cudaStream_t stream);
bool kvq_fattn_vec_d256(const kvq_fattn_args & a, ggml_type tk, ggml_type tv, bool pre, int n_kv_heads, int n_seq, cudaStream_t stream);

// The K/V pairs compiled (issue: each type with itself; f16 / q8_0 K with each V of 4 bits or fewer).
#define KVQ_FA_LOW_BIT_V(X, D, TK)                   \
    X(D, TK, GGML_TYPE_BFP4_32)                      \
    X(D, TK, GGML_TYPE_BFP4_64)                      \
    X(D, TK, GGML_TYPE_NUQ4)                         \
    X(D, TK, GGML_TYPE_NUQ3)                         \
    X(D, TK, GGML_TYPE_NUQ2)                         \
    X(D, TK, GGML_TYPE_NUQ3O)                        \
    X(D, TK, GGML_TYPE_NUQ2O)                        \
    X(D, TK, GGML_TYPE_NUQ3_64)                      \
    X(D, TK, GGML_TYPE_NUQ2_64)

#define KVQ_FA_PAIRS(X, D)                                 \
    X(D, GGML_TYPE_BFP4_32, GGML_TYPE_BFP4_32)             \
    X(D, GGML_TYPE_BFP4_64, GGML_TYPE_BFP4_64)             \
    X(D, GGML_TYPE_BFP8_32, GGML_TYPE_BFP8_32)             \
    X(D, GGML_TYPE_NUQ4,    GGML_TYPE_NUQ4)                \
    X(D, GGML_TYPE_NUQ3,    GGML_TYPE_NUQ3)                \
    X(D, GGML_TYPE_NUQ2,    GGML_TYPE_NUQ2)                \
    X(D, GGML_TYPE_NUQ3O,   GGML_TYPE_NUQ3O)               \
    X(D, GGML_TYPE_NUQ2O,   GGML_TYPE_NUQ2O)               \
    X(D, GGML_TYPE_NUQ3_64, GGML_TYPE_NUQ3_64)             \
    X(D, GGML_TYPE_NUQ2_64, GGML_TYPE_NUQ2_64)             \
    KVQ_FA_LOW_BIT_V(X, D, GGML_TYPE_F16)                  \
    KVQ_FA_LOW_BIT_V(X, D, GGML_TYPE_Q8_0)

// the V types a pre-RoPE file's budget pairs with keys split in halves (convert/layer_types.py), and q4_0
#define KVQ_FA_HALVES_K(X, D, TK)                    \
    X(D, TK, GGML_TYPE_Q4_0)                         \
    X(D, TK, GGML_TYPE_NUQ4)                         \
    X(D, TK, GGML_TYPE_NUQ3O)                        \
    X(D, TK, GGML_TYPE_NUQ3)                         \
    X(D, TK, GGML_TYPE_NUQ2O)                        \
    X(D, TK, GGML_TYPE_NUQ3_64)                      \
    X(D, TK, GGML_TYPE_NUQ2_64)

// Pairs compiled for a pre-RoPE K only: stock K / V types (upstream's kernels take them post-RoPE),
// quantized K with f16 V, and the keys split in halves (laid out for them by a pre-RoPE conversion).
#define KVQ_FA_PRE_PAIRS(X, D)                             \
    X(D, GGML_TYPE_Q8_0,    GGML_TYPE_Q8_0)                \
    X(D, GGML_TYPE_Q4_0,    GGML_TYPE_Q4_0)                \
    X(D, GGML_TYPE_Q8_0,    GGML_TYPE_Q4_0)                \
    X(D, GGML_TYPE_Q4_0,    GGML_TYPE_F16)                 \
    X(D, GGML_TYPE_Q8_0,    GGML_TYPE_F16)                 \
    X(D, GGML_TYPE_NUQ4,    GGML_TYPE_F16)                 \
    X(D, GGML_TYPE_NUQ3,    GGML_TYPE_F16)                 \
    X(D, GGML_TYPE_BFP4_32, GGML_TYPE_F16)                 \
    KVQ_FA_HALVES_K(X, D, GGML_TYPE_Q53_64)                \
    KVQ_FA_HALVES_K(X, D, GGML_TYPE_Q42_64)                \
    KVQ_FA_HALVES_K(X, D, GGML_TYPE_Q32_64)

#define KVQ_FA_CASE(D, TK, TV)                                                      \
    if (tk == TK && tv == TV) {                                                     \
        return kvq_fattn_vec_run<D, TK, TV>(a, pre, n_kv_heads, n_seq, stream);     \
    }

#define KVQ_FA_PRE_CASE(D, TK, TV)                                                  \
    if (pre && tk == TK && tv == TV) {                                              \
        kvq_fattn_vec_launch<D, TK, TV, true>(a, n_kv_heads, n_seq, stream);        \
        return true;                                                                \
    }

#define KVQ_FA_DEFINE(D)                                                                                      \
    bool kvq_fattn_vec_d##D(const kvq_fattn_args & a, ggml_type tk, ggml_type tv, bool pre, int n_kv_heads,  \
                            int n_seq, cudaStream_t stream) {                                                 \
        KVQ_FA_PAIRS(KVQ_FA_CASE, D)                                                                          \
        KVQ_FA_PRE_PAIRS(KVQ_FA_PRE_CASE, D)                                                                  \
        return false;                                                                                         \
    }

// true when the pair has a decode kernel (for any compiled D)
static inline bool kvq_fattn_vec_has_pair(ggml_type tk, ggml_type tv, bool pre) {
    if (pre && !kvq_fattn_vec_pre_ok(tk)) {
        return false;
    }
#define KVQ_FA_HAS(D, TK, TV) if (tk == TK && tv == TV) { return true; }
    KVQ_FA_PAIRS(KVQ_FA_HAS, 0)
    if (pre) {
        KVQ_FA_PRE_PAIRS(KVQ_FA_HAS, 0)
    }
#undef KVQ_FA_HAS
    return false;
}
#endif // __CUDACC__
