// CPU flash attention for quantized and mixed KV caches (patch 0008 routes
// FLASH_ATTN_EXT here when ggml_kvq_fattn_supported() says so).
//
// Upstream's fast CPU paths (split-KV decode, tiled prefill) take only f16/f32
// caches with K and V of one type. Every other cache runs row by row: each query
// head quantizes Q, re-reads and re-decodes every K and V row on its own, one
// vec_dot and one to_float per row, and decode parallelizes over heads only.
// A smaller cache then reads fewer bytes but spends more time decoding them.
//
// Here the unit of work is one KV head with the query heads that share it (GQA)
// and a tile of query tokens: R = tokens x heads rows. Each KV tile of T rows is
// decoded to f32 once for all R rows:
//   S = Q·Kᵀ    one f32 dot per (row, key) when R is small (decode), else a GEMM
//               on the transposed K tile (prefill; upstream's simd_gemm)
//   online softmax per row (mask, ALiBi slope, softcap), skipping masked tiles
//   O += P·V    simd_gemm on the decoded V tile
// When there are too few units to keep every thread busy (decode), the KV range
// is cut into chunks and threads take (unit, chunk) items; the partial (max,
// sum, O) of each chunk are merged at the end, as in upstream's split-KV path.
//
// K·Q differs from the per-row path in rounding only: Q stays f32 here where the
// per-row path quantizes it to the K type's vec_dot_type (q8_0, bfp8_32, f16).
#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"     // block_q8_0, block_q4_0
#include "ggml-kvq-cpu.h"

#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#include "simd-gemm.h"
#include "vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <vector>

namespace {

constexpr int FA_TILE_KV   = 64;   // keys per tile: K and V tiles of 64 x 128 f32 stay in L2
constexpr int FA_ROWS      = 64;   // target query rows (tokens x group heads) per unit
constexpr int FA_GEMM_ROWS = 16;   // from this many rows on, S = Q·Kᵀ is a GEMM on a transposed K tile
constexpr int FA_MIN_CHUNK = 256;  // shortest KV chunk worth a partial result
constexpr int FA_PAD       = 16;   // floats between per-thread scratch areas (one cache line)
constexpr int FA_F16_DECODE_ROWS = 16; // f16/f32 caches: batches of fewer query tokens take this path (decode)

struct fa_plan {
    int64_t DK, DV, G, TQ, R, n_qt, n_units, n_chunks, chunk;
    size_t  scratch;    // floats of scratch per thread
    size_t  partials;   // floats of partial results, all items
};

fa_plan fa_make_plan(const ggml_tensor * dst, int nth) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];

    fa_plan p;
    p.DK   = k->ne[0];
    p.DV   = v->ne[0];
    p.G    = q->ne[2] / k->ne[2];                       // query heads per KV head
    p.TQ   = std::min<int64_t>(q->ne[1], std::max<int64_t>(1, FA_ROWS / p.G));
    p.R    = p.TQ * p.G;
    p.n_qt = (q->ne[1] + p.TQ - 1) / p.TQ;
    p.n_units = q->ne[3] * k->ne[2] * p.n_qt;

    // split the KV range only when the units alone leave threads idle
    const int64_t n_kv = k->ne[1];
    p.n_chunks = 1;
    if (nth > 1 && p.n_units < 4*nth && n_kv >= 2*FA_MIN_CHUNK) {
        const int64_t want = (16*nth + p.n_units - 1) / p.n_units;
        p.n_chunks = std::max<int64_t>(1, std::min<int64_t>(want, n_kv / FA_MIN_CHUNK));
    }
    p.chunk = (n_kv + p.n_chunks - 1) / p.n_chunks;
    p.chunk = (p.chunk + FA_TILE_KV - 1) / FA_TILE_KV * FA_TILE_KV;
    p.n_chunks = (n_kv + p.chunk - 1) / p.chunk;

    // Q, K tile, K tile transposed, V tile, S/P, O, max, sum and ALiBi slope per row, mask rows per token,
    // pre-RoPE K: cos, sin, cos(w), sin(w) and the effective scale per channel, Q turned back by a tile's position
    p.scratch = p.R*p.DK + FA_TILE_KV*p.DK*2 + FA_TILE_KV*p.DV + p.R*FA_TILE_KV + p.R*p.DV + 3*p.R
              + p.TQ*FA_TILE_KV + 5*p.DK + p.R*p.DK + FA_PAD
              + FA_TILE_KV*p.DK + p.R*p.DK;     // centred K: exact cos/sin of a tile's keys, coefficients per row
    p.partials = p.n_chunks > 1 ? (size_t) (p.n_units*p.n_chunks*p.R*(2 + p.DV)) : 0;
    return p;
}

// GGML_KVQ_FA: unset or 1 = this path; 0 = upstream's per-row path; match = this
// path with Q rounded through the K type's vec_dot_type first, as the per-row path
// does, so the two agree to float summation order; all = this path for f16/f32
// caches too (both for the equivalence tests).
enum fa_mode { FA_ON, FA_OFF, FA_MATCH, FA_ALL };

// read on every node (a few per layer; getenv is cheap next to attention) so a
// test can switch paths within one process
fa_mode fa_env_mode() {
    const char * e = getenv("GGML_KVQ_FA");
    if (e == nullptr) {
        return FA_ON;
    }
    return strcmp(e, "0")     == 0 ? FA_OFF   :
           strcmp(e, "match") == 0 ? FA_MATCH :
           strcmp(e, "all")   == 0 ? FA_ALL   : FA_ON;
}

void fa_f16_to_f32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) x, y, n);
}

void fa_f32_copy(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    memcpy(y, x, n*sizeof(float));
}

// q8_0 / q4_0 rows with this target's SIMD (ggml-base's to_float is scalar and
// built for the baseline ISA)

#if defined(__AVX2__) && defined(__F16C__)
// 8 int8 -> 8 floats times d
inline void fa_store8(float * y, __m128i q8, __m256 d) {
    _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d));
}
#endif

void fa_q8_0_to_f32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    const block_q8_0 * b = (const block_q8_0 *) x;
    for (int64_t i = 0; i < n/QK8_0; ++i, y += QK8_0) {
#if defined(__AVX2__) && defined(__F16C__)
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(b[i].d));
        for (int g = 0; g < 4; ++g) {
            fa_store8(y + 8*g, _mm_loadl_epi64((const __m128i *) (b[i].qs + 8*g)), d);
        }
#else
        const float d = GGML_CPU_FP16_TO_FP32(b[i].d);
        for (int j = 0; j < 32; ++j) {
            y[j] = d*(float) b[i].qs[j];
        }
#endif
    }
}

void fa_q4_0_to_f32(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t n) {
    const block_q4_0 * b = (const block_q4_0 *) x;
    for (int64_t i = 0; i < n/QK4_0; ++i, y += QK4_0) {
#if defined(__AVX2__) && defined(__F16C__)
        const __m256  d  = _mm256_set1_ps(_cvtsh_ss(b[i].d));
        const __m128i m4 = _mm_set1_epi8(0x0F), c8 = _mm_set1_epi8(8);
        const __m128i q  = _mm_loadu_si128((const __m128i *) b[i].qs);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m4), c8);                     // values 0..15
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), c8);  // values 16..31
        fa_store8(y +  0, lo, d);
        fa_store8(y +  8, _mm_unpackhi_epi64(lo, lo), d);
        fa_store8(y + 16, hi, d);
        fa_store8(y + 24, _mm_unpackhi_epi64(hi, hi), d);
#else
        const float d = GGML_CPU_FP16_TO_FP32(b[i].d);
        for (int j = 0; j < 16; ++j) {
            y[j]      = d*(float) ((int) (b[i].qs[j] & 0x0F) - 8);
            y[j + 16] = d*(float) ((int) (b[i].qs[j] >>   4) - 8);
        }
#endif
    }
}

// row decoder for a cache type; K rows of nuq types use the K codebook (slot A)
ggml_to_float_t fa_to_float(ggml_type type, bool is_k) {
    switch (type) {
        case GGML_TYPE_F32:  return fa_f32_copy;
        case GGML_TYPE_F16:  return fa_f16_to_f32;
        case GGML_TYPE_Q8_0: return fa_q8_0_to_f32;
        case GGML_TYPE_Q4_0: return fa_q4_0_to_f32;
        default: break;
    }
    if (ggml_to_float_t f = is_k ? ggml_kvq_cpu_to_float_k(type) : ggml_kvq_cpu_to_float(type)) {
        return f;
    }
    return ggml_get_type_traits(type)->to_float;
}

// Q row -> K's vec_dot_type -> f32 (FA_MATCH only); f32/f16 K: Q as f16, as upstream
void fa_round_q(ggml_type k_type, float * x, int64_t n, void * tmp) {
    const ggml_type vt = ggml_get_type_traits_cpu(k_type)->vec_dot_type;
    if (vt == GGML_TYPE_F32) {
        return;
    }
    ggml_get_type_traits_cpu(vt)->from_float(x, tmp, n);
    fa_to_float(vt, false)(tmp, x, n);
}

inline float fa_slope(float max_bias, uint32_t h, uint32_t n_head) {
    if (max_bias <= 0.0f) {
        return 1.0f;
    }
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2(n_head));
    const float m0 = powf(2.0f, -(max_bias       ) / n_head_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / n_head_log2);
    return h < n_head_log2 ? powf(m0, h + 1) : powf(m1, 2*(h - n_head_log2) + 1);
}

#if defined(GGML_SIMD) && !defined(__ARM_FEATURE_SVE) && !defined(__riscv_v_intrinsic)
#define FA_SIMD 1
inline float fa_hsum(GGML_F32_VEC v) {
#if defined(__AVX512F__) && GGML_F32_EPR == 16
    return _mm512_reduce_add_ps(v);
#elif defined(__AVX__) && GGML_F32_EPR == 8
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
#elif defined(__ARM_NEON) && defined(__aarch64__) && GGML_F32_EPR == 4
    return vaddvq_f32(v);
#else
    float tmp[GGML_F32_EPR];
    GGML_F32_VEC_STORE(tmp, v);
    float sum = 0.0f;
    for (int i = 0; i < GGML_F32_EPR; ++i) {
        sum += tmp[i];
    }
    return sum;
#endif
}
#endif

#ifdef FA_SIMD
// out[0..3] = the horizontal sums of a0..a3, reduced together (one hadd tree instead of four chains)
inline void fa_hsum4(GGML_F32_VEC a0, GGML_F32_VEC a1, GGML_F32_VEC a2, GGML_F32_VEC a3, float * out) {
#if defined(__AVX512F__) && GGML_F32_EPR == 16
    const __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a0), 1)));
    const __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a1), 1)));
    const __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a2), 1)));
    const __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a3), 1)));
#elif defined(__AVX__) && GGML_F32_EPR == 8
    const __m256 b0 = a0, b1 = a1, b2 = a2, b3 = a3;
#endif
#if (defined(__AVX512F__) && GGML_F32_EPR == 16) || (defined(__AVX__) && GGML_F32_EPR == 8)
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));   // per 128-bit half: s0 s1 s2 s3
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
    out[0] = fa_hsum(a0);
    out[1] = fa_hsum(a1);
    out[2] = fa_hsum(a2);
    out[3] = fa_hsum(a3);
#endif
}
#endif

// S[r*n + t] = Q_r·K_t for a few rows (decode): four keys per pass share each load of Q
void fa_dots(const float * Q, int64_t R, int64_t DK, const float * Kf, int64_t n, float * S) {
#ifdef FA_SIMD
    constexpr int E = GGML_F32_EPR;
    if (DK % E == 0) {
        for (int64_t r = 0; r < R; ++r) {
            const float * q  = Q + r*DK;
            float       * sr = S + r*n;
            int64_t t = 0;
            for (; t + 4 <= n; t += 4) {
                const float * k = Kf + t*DK;
                GGML_F32_VEC a0 = GGML_F32_VEC_ZERO, a1 = GGML_F32_VEC_ZERO, a2 = GGML_F32_VEC_ZERO, a3 = GGML_F32_VEC_ZERO;
                for (int64_t d = 0; d < DK; d += E) {
                    const GGML_F32_VEC qv = GGML_F32_VEC_LOAD(q + d);
                    a0 = GGML_F32_VEC_FMA(a0, GGML_F32_VEC_LOAD(k + 0*DK + d), qv);
                    a1 = GGML_F32_VEC_FMA(a1, GGML_F32_VEC_LOAD(k + 1*DK + d), qv);
                    a2 = GGML_F32_VEC_FMA(a2, GGML_F32_VEC_LOAD(k + 2*DK + d), qv);
                    a3 = GGML_F32_VEC_FMA(a3, GGML_F32_VEC_LOAD(k + 3*DK + d), qv);
                }
                fa_hsum4(a0, a1, a2, a3, sr + t);
            }
            for (; t < n; ++t) {
                ggml_vec_dot_f32((int) DK, sr + t, 0, q, 0, Kf + t*DK, 0, 1);
            }
        }
        return;
    }
#endif
    for (int64_t r = 0; r < R; ++r) {
        for (int64_t t = 0; t < n; ++t) {
            ggml_vec_dot_f32((int) DK, S + r*n + t, 0, Q + r*DK, 0, Kf + t*DK, 0, 1);
        }
    }
}

// max of a row, eight independent chains (ggml_vec_max_f32 is one serial chain)
inline float fa_max(const float * x, int64_t n) {
    float m[8] = { -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY };
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int j = 0; j < 8; ++j) {
            m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
        }
    }
    for (; i < n; ++i) {
        m[0] = x[i] > m[0] ? x[i] : m[0];
    }
    for (int j = 1; j < 8; ++j) {
        m[0] = m[j] > m[0] ? m[j] : m[0];
    }
    return m[0];
}

// Pre-RoPE K cache (ggml-kvq.h): a decoded tile holds c = (k - mean)/scale before RoPE.
// Each row becomes k = c*scale + mean, rotated at its cell's position. cos/sin come per
// channel from arrays laid out like the row (a pair's two channels hold cos, and -sin / +sin),
// advanced from one key to the next by the rotation of angle w when the cells' positions are
// consecutive (the common case), recomputed exactly at a tile's start and after any jump.
struct fa_prerope {
    bool on = false;
    bool centred = false;            // K is H R(p)(k - mean): post-RoPE, plus q·R(p)mean per score (fa_centred)
    int  n_dims = 0;
    bool neox = false;
    float mscale = 1.0f;
    int  n_rot_h = 0;                // Walsh-Hadamard block (0: none)
    int  h_skip = 0;                 // a butterfly stride the Hadamard leaves out (0: none; ggml_kvq_fa_set_hadamard_skip)
    const int32_t * pos = nullptr;   // src[5]
    int64_t pos_stride = 0;          // per stream
    const float * mean = nullptr, * scale = nullptr, * freqs = nullptr;
    // exact window (ggml_kvq_fa_set_window): each cell's row of src[9] (-1: the quantized cell), per stream as pos
    const int32_t * win = nullptr;
    const char * win_rows = nullptr;
    size_t  win_nb1 = 0;
    int64_t win_n   = 0;             // rows of src[9]
    int64_t win_v0  = 0;             // where V starts in a row (elements)
    // per query (planes 2 and 3; nullptr: every query reads every row): the last query position that reads each
    // cell's row, and each query's position
    const int32_t * win_last = nullptr;
    const int32_t * win_qpos = nullptr;
};

fa_prerope fa_prerope_of(const ggml_tensor * dst) {
    fa_prerope pr;
    int mode = 0;
    if (!ggml_kvq_fa_get_prerope(dst, &pr.n_dims, &mode, &pr.mscale, &pr.n_rot_h)) {
        return pr;
    }
    pr.on    = true;
    pr.centred = ggml_kvq_fa_is_centred(dst);
    pr.h_skip = ggml_kvq_fa_get_hadamard_skip(dst);
    pr.neox  = mode == 2;
    pr.pos   = (const int32_t *) dst->src[5]->data;
    pr.pos_stride = dst->src[5]->nb[1] / sizeof(int32_t);
    pr.mean  = (const float *) dst->src[6]->data;
    pr.scale = (const float *) dst->src[7]->data;
    pr.freqs = (const float *) dst->src[8]->data;
    if (const ggml_tensor * rows = ggml_kvq_fa_get_window(dst)) {
        const size_t plane = dst->src[5]->nb[2] / sizeof(int32_t);
        pr.win      = pr.pos + plane;
        pr.win_rows = (const char *) rows->data;
        pr.win_nb1  = rows->nb[1];
        pr.win_n    = rows->ne[1];
        pr.win_v0   = dst->src[1]->ne[0]*dst->src[1]->ne[2];
        if (dst->src[5]->ne[2] >= 4) {
            pr.win_last = pr.pos + 2*plane;
            pr.win_qpos = pr.pos + 3*plane;
        }
    }
    return pr;
}

// the D values at element offset off of window row r, as floats
inline void fa_window_row(const fa_prerope & pr, int32_t r, int64_t off, int64_t D, float * out) {
    ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) (pr.win_rows + r*pr.win_nb1) + off, out, D);
}

// the window's rows (wrow: each cell's row, -1: none; nullptr: no window) over a decoded tile of n rows of D
inline void fa_window_rows(const fa_prerope & pr, const int32_t * wrow, int64_t n, int64_t off, int64_t D, float * tile) {
    for (int64_t t = 0; wrow && t < n; ++t) {
        if (wrow[t] >= 0) {
            fa_window_row(pr, wrow[t], off, D, tile + t*D);
        }
    }
}

// Which window rows a tile of n cells reads (wrow: plane 1 at the tile; q_lo / q_hi: the item's query positions).
// A row every query reads goes to keep (-1 elsewhere); a row read by some of the queries only (a prefill batch: the
// queries of the batch whose window still holds the cell) is listed in mixed. Returns the number listed.
inline int fa_window_split(const fa_prerope & pr, const int32_t * wrow, const int32_t * last, int64_t n,
                           int32_t q_lo, int32_t q_hi, int32_t * keep, int32_t * mixed) {
    int n_mixed = 0;
    for (int64_t t = 0; t < n; ++t) {
        const int32_t r = wrow[t];
        keep[t] = -1;
        if (r < 0 || r >= pr.win_n) {
            continue;
        }
        if (last == nullptr || q_hi <= last[t]) {
            keep[t] = r;
        } else if (q_lo <= last[t]) {
            mixed[n_mixed++] = (int32_t) t;
        }
    }
    return n_mixed;
}

// the two channels of rotary pair i: NORM (2i, 2i+1), NEOX (i, i + n_dims/2)
inline void fa_rope_pair(const fa_prerope & pr, int i, int * a, int * b) {
    *a = pr.neox ? i : 2*i;
    *b = pr.neox ? i + pr.n_dims/2 : 2*i + 1;
}

// per channel, laid out like a row: cos(p*w)*m in both channels of a pair, -sin(p*w)*m in the first, +sin in the second
inline void fa_rope_fill(const fa_prerope & pr, const float * w, int32_t p, float m, float * c, float * s) {
    for (int i = 0; i < pr.n_dims/2; ++i) {
        const float th = (float) p*w[i];
        const float ci = cosf(th)*m, si = sinf(th)*m;
        int a, b;
        fa_rope_pair(pr, i, &a, &b);
        c[a] = ci; s[a] = -si;
        c[b] = ci; s[b] =  si;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// the three butterfly stages within 8 lanes (h = 1, 2, 4): lane j becomes v[j]*sign + v[j ^ h]
inline __m256 fa_fwht8(__m256 v) {
    const __m256 sg1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 sg2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 sg4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    v = _mm256_fmadd_ps(v, sg1, _mm256_permute_ps(v, 0xB1));
    v = _mm256_fmadd_ps(v, sg2, _mm256_permute_ps(v, 0x4E));
    return _mm256_fmadd_ps(v, sg4, _mm256_permute2f128_ps(v, v, 1));
}
#endif

// the orthonormal Hadamard's factor: 1/sqrt of the number of values each output mixes
inline float fa_hadamard_norm(const fa_prerope & pr) {
    return pr.n_rot_h ? 1.0f/sqrtf((float) (pr.h_skip ? pr.n_rot_h/2 : pr.n_rot_h)) : 1.0f;
}

// unnormalized Walsh-Hadamard transform (Sylvester order) of each block of n values of x[0, DK),
// without the butterfly at stride skip (0: every stride).
// The butterfly stages commute, so the three in-register stages (h = 1, 2, 4) run first.
inline void fa_fwht(float * x, int64_t DK, int n, int skip) {
#if defined(__AVX2__) && defined(__FMA__)
    if (n % 8 == 0 && (skip == 0 || skip >= 8)) {
        for (int64_t d = 0; d < DK; d += 8) {
            _mm256_storeu_ps(x + d, fa_fwht8(_mm256_loadu_ps(x + d)));
        }
        for (int64_t b = 0; b < DK; b += n) {
            float * y = x + b;
            for (int h = 8; h < n; h *= 2) {
                if (h == skip) {
                    continue;
                }
                for (int i = 0; i < n; i += 2*h) {
                    for (int j = i; j < i + h; j += 8) {
                        const __m256 a = _mm256_loadu_ps(y + j), c = _mm256_loadu_ps(y + j + h);
                        _mm256_storeu_ps(y + j,     _mm256_add_ps(a, c));
                        _mm256_storeu_ps(y + j + h, _mm256_sub_ps(a, c));
                    }
                }
            }
        }
        return;
    }
#endif
    for (int64_t b = 0; b < DK; b += n) {
        float * y = x + b;
        for (int h = 1; h < n; h *= 2) {
            if (h == skip) {
                continue;
            }
            for (int i = 0; i < n; i += 2*h) {
                for (int j = i; j < i + h; ++j) {
                    const float a = y[j], c = y[j + h];
                    y[j]     = a + c;
                    y[j + h] = a - c;
                }
            }
        }
    }
}

// scalar: the rotary channels of one row become R·(x*sc + mu), with cos/sin laid out like the row (fa_rope_fill)
inline void fa_restore_rotate(const fa_prerope & pr, float * x, const float * sc, const float * mu, const float * c,
                              const float * s) {
    for (int k = 0; k < pr.n_dims; ++k) {
        x[k] = x[k]*sc[k] + mu[k];
    }
    for (int i = 0; i < pr.n_dims/2; ++i) {
        int a, b;
        fa_rope_pair(pr, i, &a, &b);
        const float xa = x[a], xb = x[b];
        x[a] = xa*c[a] + xb*s[a];
        x[b] = xb*c[b] + xa*s[b];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 channels of cos/sin advanced by one step of the rotation (c1, s1 = cos(w), ±sin(w)), stored back
inline void fa_rope_step8(float * c, float * s, const float * c1, const float * s1, __m256 & cv, __m256 & sv) {
    const __m256 c1v = _mm256_loadu_ps(c1), s1v = _mm256_loadu_ps(s1);
    const __m256 cn = _mm256_fmsub_ps(cv, c1v, _mm256_mul_ps(sv, s1v));
    sv = _mm256_fmadd_ps(sv, c1v, _mm256_mul_ps(cv, s1v));
    cv = cn;
    _mm256_storeu_ps(c, cv);
    _mm256_storeu_ps(s, sv);
}
#endif

// cos/sin per channel (laid out like a row, fa_rope_fill) advanced by one step of the rotation c1, s1
inline void fa_rope_advance(const fa_prerope & pr, float * c, float * s, const float * c1, const float * s1) {
    int k = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (pr.n_dims % 16 == 0) {
        for (; k < pr.n_dims; k += 8) {
            __m256 cv = _mm256_loadu_ps(c + k), sv = _mm256_loadu_ps(s + k);
            fa_rope_step8(c + k, s + k, c1 + k, s1 + k, cv, sv);
        }
    }
#endif
    for (; k < pr.n_dims; ++k) {
        const float ck = c[k];
        c[k] = ck*c1[k] - s[k]*s1[k];
        s[k] = s[k]*c1[k] + ck*s1[k];
    }
}

// one row: x*sc + mu, its rotary channels turned by the cos/sin arrays c, s (laid out like the row)
inline void fa_restore_rotate_row(const fa_prerope & pr, float * x, int64_t DK, const float * sc, const float * mu,
                                  const float * c, const float * s) {
    const int nd = pr.n_dims, hd = nd/2;
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (nd % 16 == 0) {
        if (pr.neox) {
            for (; j < hd; j += 8) {
                const int jb = j + hd;
                const __m256 xa = _mm256_fmadd_ps(_mm256_loadu_ps(x + j),  _mm256_loadu_ps(sc + j),  _mm256_loadu_ps(mu + j));
                const __m256 xb = _mm256_fmadd_ps(_mm256_loadu_ps(x + jb), _mm256_loadu_ps(sc + jb), _mm256_loadu_ps(mu + jb));
                _mm256_storeu_ps(x + j,  _mm256_fmadd_ps(xa, _mm256_loadu_ps(c + j),  _mm256_mul_ps(xb, _mm256_loadu_ps(s + j))));
                _mm256_storeu_ps(x + jb, _mm256_fmadd_ps(xb, _mm256_loadu_ps(c + jb), _mm256_mul_ps(xa, _mm256_loadu_ps(s + jb))));
            }
        } else {
            for (; j < nd; j += 8) {
                const __m256 xa = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(sc + j), _mm256_loadu_ps(mu + j));
                _mm256_storeu_ps(x + j, _mm256_fmadd_ps(xa, _mm256_loadu_ps(c + j),
                                                        _mm256_mul_ps(_mm256_permute_ps(xa, 0xB1), _mm256_loadu_ps(s + j))));
            }
        }
        j = nd;
    }
#endif
    if (j == 0) {
        fa_restore_rotate(pr, x, sc, mu, c, s);
    }
    for (int64_t d = nd; d < DK; ++d) {      // partial rotary: the rest is not rotated
        x[d] = x[d]*sc[d] + mu[d];
    }
}

// k rows of the tile: undo the Hadamard, restore scale and mean, rotate at positions pos[0..n).
// sc: this head's scale times fa_hadamard_norm (the transform runs unnormalized).
void fa_prerope_tile(const fa_prerope & pr, int64_t ik2, int64_t DK, const int32_t * pos, int64_t n, float * Kf,
                     float * cs, const float * c1, const float * s1, const float * sc) {
    const float * mu = pr.mean  + ik2*DK;
    const float * w  = pr.freqs + ik2*(pr.n_dims/2);
    float * c = cs;              // [n_dims] cos(p*w)*mscale per channel
    float * s = cs + pr.n_dims;  // [n_dims] ±sin(p*w)*mscale
    for (int64_t t = 0; t < n; ++t) {
        if (t > 0 && pos[t] == pos[t - 1] + 1) {
            fa_rope_advance(pr, c, s, c1, s1);
        } else {     // exactly: a tile's first key, or after a jump in positions
            fa_rope_fill(pr, w, pos[t], pr.mscale, c, s);
        }
        float * x = Kf + t*DK;
        if (pr.n_rot_h) {
            fa_fwht(x, DK, pr.n_rot_h, pr.h_skip);
        }
        fa_restore_rotate_row(pr, x, DK, sc, mu, c, s);
    }
}

// Decode (few query rows) over a tile whose cells hold consecutive positions p0, p0+1, ...:
// q·R(p0 + t)k = (R(p0)ᵀq)·(R(t)k). The query rows turn by -p0 once per tile and each key by its
// offset t only, read from a table of R(t)·mscale for t < FA_TILE_KV that depends on the head's
// frequencies alone, so it is built once per thread and head, not per tile (no cos/sin per key).
struct fa_rope_tab {
    std::vector<float> w;            // what it was built from: the frequencies, mscale, n_dims, mode, DK
    float mscale = 0.0f;
    int n_dims = -1;
    bool neox = false;
    int64_t DK = -1;
    std::vector<float> c, s;         // [FA_TILE_KV][DK] laid out like fa_rope_fill's arrays
    std::vector<double> c64, s64;    // [n_dims/2] the turn of one whole tile, R(FA_TILE_KV)
};

const fa_rope_tab & fa_rope_tab_for(const fa_prerope & pr, const float * w, int64_t DK) {
    thread_local fa_rope_tab tab;
    const int hd = pr.n_dims/2;
    if (tab.n_dims == pr.n_dims && tab.neox == pr.neox && tab.mscale == pr.mscale && tab.DK == DK &&
        std::equal(w, w + hd, tab.w.begin())) {
        return tab;
    }
    tab.w.assign(w, w + hd);
    tab.mscale = pr.mscale;
    tab.n_dims = pr.n_dims;
    tab.neox = pr.neox;
    tab.DK = DK;
    tab.c.assign(FA_TILE_KV*DK, 1.0f);      // channels past n_dims: not rotated
    tab.s.assign(FA_TILE_KV*DK, 0.0f);
    tab.c64.resize(hd);
    tab.s64.resize(hd);
    for (int i = 0; i < hd; ++i) {
        int a, b;
        fa_rope_pair(pr, i, &a, &b);
        const double c1 = cos((double) w[i]), s1 = sin((double) w[i]);
        double ct = 1.0, st = 0.0;           // R(t), advanced in double: exact to float over a tile
        for (int t = 0; t < FA_TILE_KV; ++t) {
            float * c = tab.c.data() + t*DK, * s = tab.s.data() + t*DK;
            c[a] = (float) (ct*pr.mscale); s[a] = (float) (-st*pr.mscale);
            c[b] = (float) (ct*pr.mscale); s[b] = (float) ( st*pr.mscale);
            const double cn = ct*c1 - st*s1;
            st = st*c1 + ct*s1;
            ct = cn;
        }
        tab.c64[i] = ct;
        tab.s64[i] = st;
    }
    return tab;
}

// the tile's cells hold positions pos[0], pos[0]+1, ..., pos[0]+n-1
inline bool fa_consecutive(const int32_t * pos, int64_t n) {
    int32_t off = 0;        // no early exit: the compiler vectorizes the loop (it runs once per tile)
    for (int64_t t = 1; t < n; ++t) {
        off |= pos[t] ^ (pos[0] + (int32_t) t);
    }
    return off == 0;
}

// cos/sin(p0 w) per pair of a tile starting at position p0: exactly, or the previous tile's turned by one
// tile (c64, s64: cos/sin(FA_TILE_KV w)) when p0 follows it, re-anchored exactly every FA_ANCHOR_STEPS tiles
// (the double recurrence drifts by ~1e-16 a step; cos/sin of every pair every 16 tiles cost 4% of decode).
constexpr int FA_ANCHOR_STEPS = 256;

// cos/sin(p w) of the pairs 0..n-1 exactly. Each work item's first tile needs them, and the same tile starts and
// frequencies come back in every head, layer and token, so each thread keeps the last ones it computed (direct
// mapped by tile and frequencies; the values are those cos/sin give, so results do not depend on the memo).
void fa_rope_exact(int32_t p, int n, const float * w, double * c, double * s) {
    struct slot {
        int32_t p = INT32_MIN;
        std::vector<float> w;
        std::vector<double> c, s;
    };
    constexpr uint32_t N_SLOTS = 64;
    thread_local std::vector<slot> memo;        // on the heap: a dlopened library has little static TLS
    if (memo.empty()) {
        memo.resize(N_SLOTS);
    }
    uint32_t wbits = 0;
    memcpy(&wbits, w + (n > 1), sizeof(wbits));     // w[0] is 1 in most models: w[1] tells heads apart
    slot & e = memo[((uint32_t) p/FA_TILE_KV ^ (wbits*0x9E3779B1u >> 26)) % N_SLOTS];
    if (e.p == p && e.w.size() == (size_t) n && std::equal(w, w + n, e.w.begin())) {
        std::copy(e.c.begin(), e.c.end(), c);
        std::copy(e.s.begin(), e.s.end(), s);
        return;
    }
    for (int j = 0; j < n; ++j) {
        const double th = (double) p*w[j];
        c[j] = cos(th);
        s[j] = sin(th);
    }
    e.p = p;
    e.w.assign(w, w + n);
    e.c.assign(c, c + n);
    e.s.assign(s, s + n);
}

struct fa_tile_anchor {
    int32_t p0 = INT32_MIN;
    int steps = 0;

    void at(int32_t p, int n, const float * w, const double * c64, const double * s64,
            double * c, double * s) {
        if (p0 != INT32_MIN && p == p0 + FA_TILE_KV && steps < FA_ANCHOR_STEPS) {
            for (int j = 0; j < n; ++j) {
                const double cn = c[j]*c64[j] - s[j]*s64[j];
                s[j] = s[j]*c64[j] + c[j]*s64[j];
                c[j] = cn;
            }
            ++steps;
        } else {
            fa_rope_exact(p, n, w, c, s);
            steps = 0;
        }
        p0 = p;
    }
};

// rows Qr = R(p0)ᵀ Q for the R query rows, given cos/sin of p0*w per pair
void fa_rope_q_back(const fa_prerope & pr, const double * cp, const double * sp, const float * Q, int64_t R, int64_t DK, float * Qr) {
    memcpy(Qr, Q, R*DK*sizeof(float));
    for (int64_t r = 0; r < R; ++r) {
        const float * q = Q + r*DK;
        float * y = Qr + r*DK;
        for (int i = 0; i < pr.n_dims/2; ++i) {
            int a, b;
            fa_rope_pair(pr, i, &a, &b);
            const float c = (float) cp[i], s = (float) sp[i];
            y[a] = q[a]*c + q[b]*s;
            y[b] = q[b]*c - q[a]*s;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// fa_prerope_tile_rel with each row held in registers through the transform, scale, mean and
// rotation (head sizes 64 and 128, full rotary, Hadamard blocks of 8 .. DK). NVH (the Hadamard
// block in vectors, 0: none) and SKV (the left-out butterfly stride in vectors, 0: none) are template
// arguments so that every index into v[] is a constant.
template <int NV, int NVH, int SKV = 0>
void fa_prerope_rows(const fa_prerope & pr, int64_t ik2, float * Kf, int64_t n, const float * sc, const fa_rope_tab & tab) {
    constexpr int DK = 8*NV;
    const float * mu = pr.mean + ik2*DK;
    for (int64_t t = 0; t < n; ++t) {
        float * x = Kf + t*DK;
        const float * c = tab.c.data() + t*DK, * s = tab.s.data() + t*DK;
        __m256 v[NV];
        #pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) {
            v[i] = _mm256_loadu_ps(x + 8*i);
        }
        if (NVH) {
            #pragma GCC unroll 16
            for (int i = 0; i < NV; ++i) {
                v[i] = fa_fwht8(v[i]);
            }
            #pragma GCC unroll 16
            for (int h = 1; h < NVH; h *= 2) {
                if (h == SKV) {
                    continue;
                }
                #pragma GCC unroll 16
                for (int i = 0; i < NV; i += 2*h) {
                    #pragma GCC unroll 16
                    for (int j = i; j < i + h; ++j) {
                        const __m256 a = v[j], b = v[j + h];
                        v[j]     = _mm256_add_ps(a, b);
                        v[j + h] = _mm256_sub_ps(a, b);
                    }
                }
            }
        }
        #pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) {
            v[i] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(sc + 8*i), _mm256_loadu_ps(mu + 8*i));
        }
        if (pr.neox) {
            #pragma GCC unroll 16
            for (int i = 0; i < NV/2; ++i) {
                const int ib = i + NV/2;
                const __m256 a = v[i], b = v[ib];
                v[i]  = _mm256_fmadd_ps(a, _mm256_loadu_ps(c + 8*i),  _mm256_mul_ps(b, _mm256_loadu_ps(s + 8*i)));
                v[ib] = _mm256_fmadd_ps(b, _mm256_loadu_ps(c + 8*ib), _mm256_mul_ps(a, _mm256_loadu_ps(s + 8*ib)));
            }
        } else {
            #pragma GCC unroll 16
            for (int i = 0; i < NV; ++i) {
                v[i] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(c + 8*i), _mm256_mul_ps(_mm256_permute_ps(v[i], 0xB1), _mm256_loadu_ps(s + 8*i)));
            }
        }
        #pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) {
            _mm256_storeu_ps(x + 8*i, v[i]);
        }
    }
}
#endif

#if defined(__AVX512F__)
// one butterfly stage of stride H < 16 within 16 lanes: lane j becomes v[j]*sign + v[j ^ H]
template <int H>
inline __m512 fa_fwht16_stage(__m512 v) {
    constexpr __mmask16 neg = H == 1 ? 0xAAAA : H == 2 ? 0xCCCC : H == 4 ? 0xF0F0 : 0xFF00;   // lanes with j & H
    const __m512 sg = _mm512_mask_blend_ps(neg, _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f));
    const __m512 partner = H == 1 ? _mm512_permute_ps(v, 0xB1) : H == 2 ? _mm512_permute_ps(v, 0x4E) :
                           H == 4 ? _mm512_shuffle_f32x4(v, v, 0xB1) : _mm512_shuffle_f32x4(v, v, 0x4E);
    return _mm512_fmadd_ps(v, sg, partner);
}

// fa_prerope_rows in 16 lanes: a 64-wide row is 4 registers, so the transform takes half the instructions, and the
// head's scale and mean stay in registers over the tile. The same butterflies in the same order (a multiply by
// +-1 in an FMA is exact): the same bits as the 8-lane version. HB: the Hadamard block in values (0: none),
// SKIP: the left-out butterfly stride in values (0: none, else >= 16).
template <int NV, int HB, int SKIP = 0>
void fa_prerope_rows16(const fa_prerope & pr, int64_t ik2, float * Kf, int64_t n, const float * sc, const fa_rope_tab & tab) {
    static_assert(SKIP == 0 || SKIP >= 16, "strides below a register are always applied");
    constexpr int DK = 16*NV;
    const float * mu = pr.mean + ik2*DK;
    __m512 vsc[NV], vmu[NV];
    #pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
        vsc[i] = _mm512_loadu_ps(sc + 16*i);
        vmu[i] = _mm512_loadu_ps(mu + 16*i);
    }
    for (int64_t t = 0; t < n; ++t) {
        float * x = Kf + t*DK;
        const float * c = tab.c.data() + t*DK, * s = tab.s.data() + t*DK;
        __m512 v[NV];
        #pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) {
            v[i] = _mm512_loadu_ps(x + 16*i);
            if (HB > 1) { v[i] = fa_fwht16_stage<1>(v[i]); }
            if (HB > 2) { v[i] = fa_fwht16_stage<2>(v[i]); }
            if (HB > 4) { v[i] = fa_fwht16_stage<4>(v[i]); }
            if (HB > 8) { v[i] = fa_fwht16_stage<8>(v[i]); }
        }
        #pragma GCC unroll 16
        for (int h = 1; 16*h < HB; h *= 2) {
            if (16*h == SKIP) {
                continue;
            }
            #pragma GCC unroll 16
            for (int i = 0; i < NV; i += 2*h) {
                #pragma GCC unroll 16
                for (int j = i; j < i + h; ++j) {
                    const __m512 a = v[j], b = v[j + h];
                    v[j]     = _mm512_add_ps(a, b);
                    v[j + h] = _mm512_sub_ps(a, b);
                }
            }
        }
        #pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) {
            v[i] = _mm512_fmadd_ps(v[i], vsc[i], vmu[i]);
        }
        if (pr.neox) {
            #pragma GCC unroll 16
            for (int i = 0; i < NV/2; ++i) {
                const int ib = i + NV/2;
                const __m512 a = v[i], b = v[ib];
                v[i]  = _mm512_fmadd_ps(a, _mm512_loadu_ps(c + 16*i),  _mm512_mul_ps(b, _mm512_loadu_ps(s + 16*i)));
                v[ib] = _mm512_fmadd_ps(b, _mm512_loadu_ps(c + 16*ib), _mm512_mul_ps(a, _mm512_loadu_ps(s + 16*ib)));
            }
        } else {
            #pragma GCC unroll 16
            for (int i = 0; i < NV; ++i) {
                v[i] = _mm512_fmadd_ps(v[i], _mm512_loadu_ps(c + 16*i),
                                       _mm512_mul_ps(_mm512_permute_ps(v[i], 0xB1), _mm512_loadu_ps(s + 16*i)));
            }
        }
        #pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) {
            _mm512_storeu_ps(x + 16*i, v[i]);
        }
    }
}
#endif

// fa_prerope_rows for this head size and layout, or false
bool fa_prerope_rows_any(const fa_prerope & pr, int64_t ik2, int64_t DK, float * Kf, int64_t n, const float * sc,
                         const fa_rope_tab & tab) {
#if defined(__AVX512F__)
    if (pr.n_dims == DK && (DK == 64 || DK == 128)) {
        using fn = void (*)(const fa_prerope &, int64_t, float *, int64_t, const float *, const fa_rope_tab &);
        // by head size, then Hadamard block: none, 8, 16, 32, 64, 128 (a block no larger than the head)
        static const fn t64[]  = { fa_prerope_rows16<4, 0>, fa_prerope_rows16<4, 8>,  fa_prerope_rows16<4, 16>,
                                   fa_prerope_rows16<4, 32>, fa_prerope_rows16<4, 64> };
        static const fn t128[] = { fa_prerope_rows16<8, 0>, fa_prerope_rows16<8, 8>,  fa_prerope_rows16<8, 16>,
                                   fa_prerope_rows16<8, 32>, fa_prerope_rows16<8, 64>, fa_prerope_rows16<8, 128> };
        fn f = nullptr;
        const int b = pr.n_rot_h == 0 ? 0 : pr.n_rot_h >= 8 && pr.n_rot_h <= DK && (pr.n_rot_h & (pr.n_rot_h - 1)) == 0
                    ? __builtin_ctz(pr.n_rot_h) - 2 : -1;     // 8 -> 1, 16 -> 2, ...
        if (pr.h_skip == 0 && b >= 0) {
            f = DK == 64 ? t64[b] : t128[b];
        } else if (DK == 128 && pr.n_rot_h == 128 && pr.h_skip == 32) {
            f = fa_prerope_rows16<8, 128, 32>;    // q53_64 keys on a 128 head (llama_kvq_new_k_rot)
        }
        if (f) {
            f(pr, ik2, Kf, n, sc, tab);
            return true;
        }
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (pr.n_dims == DK) {
        using fn = void (*)(const fa_prerope &, int64_t, float *, int64_t, const float *, const fa_rope_tab &);
        fn f = nullptr;
        // by head size, then Hadamard block: none, 8, 16, 32, 64, 128 (a block no larger than the head)
        static const fn t64[]  = { fa_prerope_rows<8, 0>,  fa_prerope_rows<8, 1>,  fa_prerope_rows<8, 2>,
                                   fa_prerope_rows<8, 4>,  fa_prerope_rows<8, 8> };
        static const fn t128[] = { fa_prerope_rows<16, 0>, fa_prerope_rows<16, 1>, fa_prerope_rows<16, 2>,
                                   fa_prerope_rows<16, 4>, fa_prerope_rows<16, 8>, fa_prerope_rows<16, 16> };
        int i = -1;
        for (int b = 0, n = 0; n <= DK; n = n ? 2*n : 8, ++b) {
            if (pr.n_rot_h == n) {
                i = b;
                break;
            }
        }
        if (pr.h_skip == 0) {
            f = i < 0 ? nullptr : DK == 64 ? t64[i] : DK == 128 ? t128[i] : nullptr;
        } else if (DK == 128 && pr.n_rot_h == 128 && pr.h_skip == 32) {
            f = fa_prerope_rows<16, 16, 4>;    // q53_64 keys on a 128 head (llama_kvq_new_k_rot)
        }
        if (f) {
            f(pr, ik2, Kf, n, sc, tab);
            return true;
        }
    }
#endif
    GGML_UNUSED(pr); GGML_UNUSED(ik2); GGML_UNUSED(DK); GGML_UNUSED(Kf); GGML_UNUSED(n); GGML_UNUSED(sc);
    GGML_UNUSED(tab);
    return false;
}

// k rows of a consecutive tile: undo the Hadamard, restore scale and mean, turn row t by R(t)
void fa_prerope_tile_rel(const fa_prerope & pr, int64_t ik2, int64_t DK, int64_t n, float * Kf, const float * sc,
                         const fa_rope_tab & tab) {
    if (fa_prerope_rows_any(pr, ik2, DK, Kf, n, sc, tab)) {
        return;
    }
    const float * mu = pr.mean + ik2*DK;
    for (int64_t t = 0; t < n; ++t) {
        float * x = Kf + t*DK;
        if (pr.n_rot_h) {
            fa_fwht(x, DK, pr.n_rot_h, pr.h_skip);
        }
        fa_restore_rotate_row(pr, x, DK, sc, mu, tab.c.data() + t*DK, tab.s.data() + t*DK);
    }
}

// Centred post-RoPE K: the score of row r and a key at position p gains
//   q_r·R(p)m = sum over pairs j with a mean of  al_rj cos(p w_j) + be_rj sin(p w_j),
//   al = q_a m_a + q_b m_b, be = q_b m_a - q_a m_b (q unrotated: H q turned back; m times mscale).
// For a tile of consecutive positions p0 + t the coefficients turn by p0 once per tile and the
// cos/sin of t come from a per-head table T; other tiles take exact cos/sin per key.

// What depends only on a head's kept pairs and their frequencies, built once per thread and head: the
// relative table T [2 np][FA_TILE_KV] (cos, sin of t w_j), one tile's turn, and T's low-rank form
// T ~ P B: B holds r orthonormal rows over the tile's offsets, P [2 np][rp] (pivoted Gram-Schmidt, stopped
// when no entry of T - P B exceeds FA_CENTRED_TOL). Slow pairs hardly change over 64 offsets and fast
// ones share directions, so r is about 8.5 per head where 2 np is 18 (SmolLM2) or 27 (Qwen2.5): a tile's
// mean scores then cost r FMAs per key and row (after 2 np x rp per row and tile) instead of 2 np.
constexpr double FA_CENTRED_TOL = 1e-6;     // |cos|, |sin| <= 1: the float table itself is good to 6e-8

struct fa_centred_head {
    std::vector<int> pair;
    std::vector<float> w;
    std::vector<float> tab;          // T (kept only without the low-rank form)
    std::vector<double> c64, s64;    // [np] cos/sin(FA_TILE_KV w): the turn of one tile
    int r = 0, rp = 0;               // rank of the low-rank form (0: T itself is cheaper), r rounded up to 8
    std::vector<float> B, P;         // [r][FA_TILE_KV], [2 np][rp]
};

void fa_centred_head_build(fa_centred_head & h, const int * pair, const float * w, int np) {
    h.pair.assign(pair, pair + np);
    h.w.assign(w, w + np);
    h.tab.resize(2*np*FA_TILE_KV);
    h.c64.resize(np);
    h.s64.resize(np);
    std::vector<double> res(2*np*FA_TILE_KV);    // T in double, then what the basis leaves of it
    for (int j = 0; j < np; ++j) {
        const double c1 = cos((double) w[j]), s1 = sin((double) w[j]);
        double ct = 1.0, st = 0.0;
        for (int t = 0; t < FA_TILE_KV; ++t) {
            res[j*FA_TILE_KV + t]        = ct;
            res[(np + j)*FA_TILE_KV + t] = st;
            h.tab[j*FA_TILE_KV + t]        = (float) ct;
            h.tab[(np + j)*FA_TILE_KV + t] = (float) st;
            const double cn = ct*c1 - st*s1;
            st = st*c1 + ct*s1;
            ct = cn;
        }
        h.c64[j] = ct;
        h.s64[j] = st;
    }
    const int m = 2*np;
    std::vector<double> B, P(m*FA_TILE_KV, 0.0);
    int r = 0;
    for (; r < FA_TILE_KV; ++r) {
        int best = -1;
        double best_n2 = 0.0, worst = 0.0;
        for (int i = 0; i < m; ++i) {
            double n2 = 0.0;
            for (int t = 0; t < FA_TILE_KV; ++t) {
                n2 += res[i*FA_TILE_KV + t]*res[i*FA_TILE_KV + t];
                worst = std::max(worst, fabs(res[i*FA_TILE_KV + t]));
            }
            if (n2 > best_n2) {
                best_n2 = n2;
                best = i;
            }
        }
        if (worst <= FA_CENTRED_TOL) {
            break;
        }
        const double inv = 1.0/sqrt(best_n2);
        B.resize((r + 1)*FA_TILE_KV);
        double * q = B.data() + r*FA_TILE_KV;
        for (int t = 0; t < FA_TILE_KV; ++t) {
            q[t] = res[best*FA_TILE_KV + t]*inv;
        }
        for (int i = 0; i < m; ++i) {
            double d = 0.0;
            for (int t = 0; t < FA_TILE_KV; ++t) {
                d += res[i*FA_TILE_KV + t]*q[t];
            }
            P[i*FA_TILE_KV + r] = d;
            for (int t = 0; t < FA_TILE_KV; ++t) {
                res[i*FA_TILE_KV + t] -= d*q[t];
            }
        }
    }
    const int rp = (r + 7)/8*8;
    // per row and tile: 2 np x rp to gather the coefficients, r x FA_TILE_KV to score; the table: 2 np x FA_TILE_KV
    if (r > 0 && rp*m + r*FA_TILE_KV >= m*FA_TILE_KV) {
        r = 0;
    }
    h.r = r;
    h.rp = r ? rp : 0;
    if (r) {
        std::vector<float>().swap(h.tab);      // the low-rank form replaces it (other tiles use exact cos/sin)
    }
    h.B.assign(B.begin(), B.begin() + r*FA_TILE_KV);
    h.P.assign(m*h.rp, 0.0f);
    for (int i = 0; i < m && r; ++i) {
        for (int k = 0; k < r; ++k) {
            h.P[i*h.rp + k] = (float) P[i*FA_TILE_KV + k];
        }
    }
}

// this thread's fa_centred_head for the pairs (pair, w): the KV heads of every layer, each built once
const fa_centred_head & fa_centred_head_for(const int * pair, const float * w, int np) {
    thread_local std::unordered_map<uint64_t, fa_centred_head> heads;
    uint64_t key = 1469598103934665603ull ^ (uint64_t) np;
    for (int j = 0; j < np; ++j) {
        uint32_t wb;
        memcpy(&wb, w + j, sizeof(wb));
        key = (key ^ (uint64_t) pair[j]) * 1099511628211ull;
        key = (key ^ wb) * 1099511628211ull;
    }
    auto it = heads.find(key);
    if (it != heads.end() && it->second.pair.size() == (size_t) np &&
        std::equal(pair, pair + np, it->second.pair.begin()) && std::equal(w, w + np, it->second.w.begin())) {
        return it->second;
    }
    if (heads.size() >= 4096) {     // a bound for processes that load many models
        heads.clear();
    }
    fa_centred_head & h = heads[key];
    fa_centred_head_build(h, pair, w, np);
    return h;
}

struct fa_centred {
    int np = 0;                      // pairs with a non-zero mean in this head
    std::vector<int> pair;
    std::vector<float> w;            // their frequencies
    std::vector<double> c0, s0;      // cos/sin(p0 w) of the current tile (anchor)
    fa_tile_anchor anchor;
    std::vector<float> cc, ss;       // c0, s0 in float
    std::vector<float> g;            // one row's weights of the table's (or B's) rows
    std::vector<float> ab;           // one row's coefficients turned by the tile's position
    const fa_centred_head * head = nullptr;
};

// coefficients of every row (coef: [R][2 np]) and this head's table (c.head)
void fa_centred_setup(const fa_prerope & pr, int64_t ik2, int64_t DK, const float * Q, int64_t R, float * qtmp,
                      float * coef, fa_centred & c) {
    const float * mu = pr.mean + ik2*DK;
    const float * w  = pr.freqs + ik2*(pr.n_dims/2);
    c.np = 0;
    c.anchor = fa_tile_anchor();
    c.c0.resize(pr.n_dims/2);
    c.s0.resize(pr.n_dims/2);
    c.pair.resize(pr.n_dims/2);
    c.w.resize(pr.n_dims/2);
    c.cc.resize(pr.n_dims/2);
    c.ss.resize(pr.n_dims/2);
    c.g.resize(std::max(pr.n_dims, FA_TILE_KV));
    c.ab.resize(pr.n_dims);
    for (int i = 0; i < pr.n_dims/2; ++i) {
        int a, b;
        fa_rope_pair(pr, i, &a, &b);
        if (mu[a] != 0.0f || mu[b] != 0.0f) {
            c.w[c.np] = w[i];
            c.pair[c.np++] = i;
        }
    }
    const int np = c.np;
    const float hs = fa_hadamard_norm(pr);
    for (int64_t r = 0; r < R; ++r) {
        const float * q = Q + r*DK;
        if (pr.n_rot_h) {
            for (int64_t d = 0; d < DK; ++d) {
                qtmp[d] = q[d]*hs;
            }
            fa_fwht(qtmp, DK, pr.n_rot_h, pr.h_skip);
            q = qtmp;
        }
        float * al = coef + r*2*np, * be = al + np;
        for (int j = 0; j < np; ++j) {
            int a, b;
            fa_rope_pair(pr, c.pair[j], &a, &b);
            const float ma = mu[a]*pr.mscale, mb = mu[b]*pr.mscale;
            al[j] = q[a]*ma + q[b]*mb;
            be[j] = q[b]*ma - q[a]*mb;
        }
    }
    c.head = np ? &fa_centred_head_for(c.pair.data(), c.w.data(), np) : nullptr;
}

// g[0..rp) = sum over i < m of ab[i] P[i][0..rp): 8 weights per pass, held in registers through every pair
inline void fa_centred_weights(const float * GGML_RESTRICT ab, const float * GGML_RESTRICT P, int m, int rp,
                               float * GGML_RESTRICT g) {
#if defined(__AVX2__) && defined(__FMA__)
    for (int k = 0; k < rp; k += 8) {
        __m256 x = _mm256_setzero_ps(), y = _mm256_setzero_ps();    // two chains: half the FMA latency
        int i = 0;
        for (; i + 1 < m; i += 2) {
            x = _mm256_fmadd_ps(_mm256_set1_ps(ab[i]),     _mm256_loadu_ps(P + i*rp + k),       x);
            y = _mm256_fmadd_ps(_mm256_set1_ps(ab[i + 1]), _mm256_loadu_ps(P + (i + 1)*rp + k), y);
        }
        if (i < m) {
            x = _mm256_fmadd_ps(_mm256_set1_ps(ab[i]), _mm256_loadu_ps(P + i*rp + k), x);
        }
        _mm256_storeu_ps(g + k, _mm256_add_ps(x, y));
    }
#else
    for (int k = 0; k < rp; ++k) {
        float x = 0.0f;
        for (int i = 0; i < m; ++i) {
            x += ab[i]*P[i*rp + k];
        }
        g[k] = x;
    }
#endif
}

// S (R x n) += each row's mean scores for the tile's keys at positions pos[0..n)
void fa_centred_bias(fa_centred & c, const int32_t * pos, int64_t R, int64_t n, const float * coef, float * exact,
                     float * S) {
    const int np = c.np;
    if (np == 0) {
        return;
    }
    const fa_centred_head & h = *c.head;
    const float * T = h.tab.data();
    float * cc = c.cc.data(), * ss = c.ss.data();
    const bool rel = fa_consecutive(pos, n);
    if (rel) {
        c.anchor.at(pos[0], np, c.w.data(), h.c64.data(), h.s64.data(), c.c0.data(), c.s0.data());
        for (int j = 0; j < np; ++j) {
            cc[j] = (float) c.c0[j];
            ss[j] = (float) c.s0[j];
        }
    } else {
        for (int j = 0; j < np; ++j) {
            for (int64_t t = 0; t < n; ++t) {
                const double th = (double) pos[t]*c.w[j];
                exact[j*FA_TILE_KV + t]        = (float) cos(th);
                exact[(np + j)*FA_TILE_KV + t] = (float) sin(th);
            }
        }
        T = exact;
        c.anchor.p0 = INT32_MIN;
    }
    // the low-rank form: rows of B instead of T's, each weighted by g = the turned coefficients times P
    const bool low = rel && h.r > 0;
    const int nb = low ? h.r : 2*np;
    float * g = c.g.data();
    for (int64_t r = 0; r < R; ++r) {
        const float * al = coef + r*2*np, * be = al + np;
        float * GGML_RESTRICT sr = S + r*n;
        const float * rows = T;
        if (low) {
            // al cos(p0 w + t w) + be sin(p0 w + t w) = (al c0 + be s0) cos(t w) + (be c0 - al s0) sin(t w)
            float * GGML_RESTRICT ab = c.ab.data();
            for (int j = 0; j < np; ++j) {
                ab[j]      = al[j]*cc[j] + be[j]*ss[j];
                ab[np + j] = be[j]*cc[j] - al[j]*ss[j];
            }
            fa_centred_weights(ab, h.P.data(), 2*np, h.rp, g);
            rows = h.B.data();
        } else {
            for (int j = 0; j < np; ++j) {
                g[j]      = rel ? al[j]*cc[j] + be[j]*ss[j] : al[j];
                g[np + j] = rel ? be[j]*cc[j] - al[j]*ss[j] : be[j];
            }
        }
#if defined(__AVX2__) && defined(__FMA__)
        if (n == FA_TILE_KV) {      // a whole tile: the row's 64 scores stay in registers through every basis row
            __m256 acc[FA_TILE_KV/8];
            #pragma GCC unroll 8
            for (int i = 0; i < FA_TILE_KV/8; ++i) {
                acc[i] = _mm256_loadu_ps(sr + 8*i);
            }
            for (int k = 0; k < nb; ++k) {
                const __m256 a = _mm256_set1_ps(g[k]);
                const float * bk = rows + k*FA_TILE_KV;
                #pragma GCC unroll 8
                for (int i = 0; i < FA_TILE_KV/8; ++i) {
                    acc[i] = _mm256_fmadd_ps(a, _mm256_loadu_ps(bk + 8*i), acc[i]);
                }
            }
            #pragma GCC unroll 8
            for (int i = 0; i < FA_TILE_KV/8; ++i) {
                _mm256_storeu_ps(sr + 8*i, acc[i]);
            }
            continue;
        }
#endif
        for (int k = 0; k < nb; ++k) {
            const float gk = g[k];
            const float * GGML_RESTRICT bk = rows + k*FA_TILE_KV;
            for (int64_t t = 0; t < n; ++t) {
                sr[t] += gk*bk[t];
            }
        }
    }
}

// a unit: KV head ik2 of sequence iq3 with its G query heads, tokens j0 .. j0+nt
struct fa_unit {
    int64_t iq3, ik2, j0, nt, R;
};

fa_unit fa_unit_at(const fa_plan & p, const ggml_tensor * q, int64_t u) {
    fa_unit w;
    const int64_t n_kvh = q->ne[2] / p.G;
    w.iq3 = u / (n_kvh*p.n_qt);
    w.ik2 = (u / p.n_qt) % n_kvh;
    w.j0  = (u % p.n_qt) * p.TQ;
    w.nt  = std::min<int64_t>(p.TQ, q->ne[1] - w.j0);
    w.R   = w.nt * p.G;
    return w;
}

struct fa_scratch {
    float * Q, * Kf, * Kt, * Vf, * S, * O, * M, * L, * slope, * mask, * rope, * Qr, * cexact, * ccoef;
};

fa_scratch fa_scratch_at(const fa_plan & p, float * base) {
    fa_scratch s;
    s.Q    = base;
    s.Kf   = s.Q  + p.R*p.DK;
    s.Kt   = s.Kf + FA_TILE_KV*p.DK;
    s.Vf   = s.Kt + FA_TILE_KV*p.DK;
    s.S    = s.Vf + FA_TILE_KV*p.DV;
    s.O    = s.S  + p.R*FA_TILE_KV;
    s.M    = s.O  + p.R*p.DV;
    s.L    = s.M  + p.R;
    s.slope = s.L + p.R;
    s.mask = s.slope + p.R;
    s.rope = s.mask + p.TQ*FA_TILE_KV;
    s.Qr   = s.rope + 5*p.DK;
    s.cexact = s.Qr + p.R*p.DK + FA_PAD;
    s.ccoef  = s.cexact + FA_TILE_KV*p.DK;
    return s;
}

// One (unit, KV range) item: rows are (token jj, group head g) at r = jj*G + g.
// Leaves the unnormalized O, the running max M and the sum L per row in scratch.
void fa_run_item(const fa_plan & p, const ggml_tensor * dst, const fa_unit & w, int64_t ic0, int64_t ic1,
                 const fa_scratch & s, ggml_to_float_t k_to_float, ggml_to_float_t v_to_float, bool match,
                 const fa_prerope & pr) {
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * v    = dst->src[2];
    const ggml_tensor * mask = dst->src[3];

    float scale, max_bias, softcap;
    memcpy(&scale,    (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&softcap,  (const float *) dst->op_params + 2, sizeof(float));
    if (softcap != 0.0f) {
        scale /= softcap;
    }

    const int64_t DK = p.DK, DV = p.DV, G = p.G, R = w.R;
    const int64_t ik3 = w.iq3 / (q->ne[3] / k->ne[3]);
    const int64_t iv3 = w.iq3 / (q->ne[3] / v->ne[3]);
    const uint32_t n_head = (uint32_t) q->ne[2];

    // Q rows, pre-scaled: S = (scale·Q)·K
    for (int64_t jj = 0; jj < w.nt; ++jj) {
        for (int64_t g = 0; g < G; ++g) {
            const int64_t h = w.ik2*G + g;
            const float * pq = (const float *) ((const char *) q->data + (w.j0 + jj)*q->nb[1] + h*q->nb[2] + w.iq3*q->nb[3]);
            float * qr = s.Q + (jj*G + g)*DK;
            if (match) {
                memcpy(qr, pq, DK*sizeof(float));
                fa_round_q(k->type, qr, DK, s.Kt); // the K tiles are not in use yet
                ggml_vec_scale_f32((int) DK, qr, scale);
            } else {
                for (int64_t d = 0; d < DK; ++d) {
                    qr[d] = pq[d]*scale;
                }
            }
        }
    }
    for (int64_t r = 0; r < R; ++r) {
        s.M[r] = -INFINITY;
        s.L[r] = 0.0f;
        s.slope[r] = fa_slope(max_bias, (uint32_t) (w.ik2*G + r % G), n_head);
    }
    memset(s.O, 0, R*DV*sizeof(float));

    // pre-RoPE K: this head's one-step rotations (after the cos/sin of the current key)
    float * rope_cs = s.rope, * rope_c1 = s.rope + 2*DK, * rope_s1 = s.rope + 3*DK, * rope_sc = s.rope + 4*DK;
    const int32_t * kpos = pr.on ? pr.pos + ik3*pr.pos_stride : nullptr;   // the cells' positions
    bool rope_step = false;     // rope_c1/s1 filled: only tiles of non-consecutive positions need them
    if (pr.on && !pr.centred) {
        const float f = fa_hadamard_norm(pr);
        for (int64_t d = 0; d < DK; ++d) {
            rope_sc[d] = pr.scale[w.ik2*DK + d]*f;
        }
    }
    // decode: tiles of consecutive cells turn Q back by the tile's position instead (fa_rope_tab)
    const int hd = pr.n_dims/2;
    constexpr int FA_MAX_PAIRS = 256;
    const fa_rope_tab * tab = pr.on && !pr.centred && R < FA_GEMM_ROWS && hd <= FA_MAX_PAIRS ? &fa_rope_tab_for(pr, pr.freqs + w.ik2*hd, DK) : nullptr;
    // centred K: the mean's scores (the K tiles are not in use yet: one serves as a row of Q turned back)
    thread_local fa_centred cen;
    if (pr.centred) {
        fa_centred_setup(pr, w.ik2, DK, s.Q, R, s.Kt, s.ccoef, cen);
    }
    double q_c[FA_MAX_PAIRS], q_s[FA_MAX_PAIRS];
    fa_tile_anchor q_at;

    // one mask row per token serves every head of the group unless the mask has a head dimension
    const bool mask_per_head = mask && mask->ne[2] > 1;

    // exact window per query: this item's queries' positions, each cell's last reader (ggml_kvq_fa_set_window)
    const int32_t * win_last = pr.win_last ? pr.win_last + ik3*pr.pos_stride : nullptr;
    const int32_t * win_qpos = pr.win_qpos ? pr.win_qpos + ik3*pr.pos_stride : nullptr;
    int32_t q_lo = INT32_MAX, q_hi = INT32_MIN;
    for (int64_t jj = 0; win_qpos && jj < w.nt; ++jj) {
        q_lo = std::min(q_lo, win_qpos[w.j0 + jj]);
        q_hi = std::max(q_hi, win_qpos[w.j0 + jj]);
    }
    thread_local std::vector<float> win_ke, win_vd;

    for (int64_t ic = ic0; ic < ic1; ic += FA_TILE_KV) {
        int64_t n = std::min<int64_t>(FA_TILE_KV, ic1 - ic);

        // keys after the last one any row sees are neither decoded nor used (the end of the
        // filled cache, the causal edge); a tile nobody sees is skipped
        if (mask && !mask_per_head) {
            int64_t n_vis = 0;
            for (int64_t jj = 0; jj < w.nt; ++jj) {
                const ggml_fp16_t * mp = (const ggml_fp16_t *) ((const char *) mask->data + (w.j0 + jj)*mask->nb[1]
                                                                + (w.iq3 % mask->ne[3])*mask->nb[3]) + ic;
                float * mr = s.mask + jj*FA_TILE_KV;
                ggml_cpu_fp16_to_fp32(mp, mr, n);
                for (int64_t t = n - 1; t >= n_vis; --t) {
                    if (mr[t] != -INFINITY) {
                        n_vis = t + 1;
                        break;
                    }
                }
            }
            if (n_vis == 0) {
                continue;
            }
            n = n_vis;
        }

        // K tile -> f32, then S = Q·Kᵀ (S is R x n, row stride n)
        for (int64_t t = 0; t < n; ++t) {
            k_to_float((const char *) k->data + (ic + t)*k->nb[1] + w.ik2*k->nb[2] + ik3*k->nb[3], s.Kf + t*DK, DK);
        }
        // cells of the exact window: their unquantized row instead (the same domain, so the same transform follows).
        // A row only some queries read (mixed): a second tile Ke holds it, its scores and values patched per query.
        int32_t wkeep[FA_TILE_KV], wmixed[FA_TILE_KV];
        int n_mixed = 0;
        const int32_t * wrow = nullptr;
        const int32_t * wp = pr.win ? pr.win + ik3*pr.pos_stride + ic : nullptr;   // plane 1 at the tile
        if (wp) {
            // most tiles hold no window row: one vectorized pass says so (decode reads every tile of the cache)
            int32_t any = -1;
            for (int64_t t = 0; t < n; ++t) {
                any = std::max(any, wp[t]);
            }
            if (any >= 0) {
                n_mixed = fa_window_split(pr, wp, win_last ? win_last + ic : nullptr, n, q_lo, q_hi, wkeep, wmixed);
                wrow = wkeep;
            }
        }
        fa_window_rows(pr, wrow, n, w.ik2*DK, DK, s.Kf);
        float * Ke = nullptr;
        if (n_mixed > 0) {
            win_ke.resize(FA_TILE_KV*DK);
            Ke = win_ke.data();
            memcpy(Ke, s.Kf, n*DK*sizeof(float));
            for (int m = 0; m < n_mixed; ++m) {
                const int32_t t = wmixed[m];
                fa_window_row(pr, wp[t], w.ik2*DK, DK, Ke + t*DK);
            }
        }
        const float * Qd = s.Q;     // Q, or Q turned back by the tile's position
        if (pr.on && !pr.centred) {
            const int32_t * tp = kpos + ic;
            if (tab && fa_consecutive(tp, n)) {
                q_at.at(tp[0], hd, pr.freqs + w.ik2*hd, tab->c64.data(), tab->s64.data(), q_c, q_s);
                fa_rope_q_back(pr, q_c, q_s, s.Q, R, DK, s.Qr);
                fa_prerope_tile_rel(pr, w.ik2, DK, n, s.Kf, rope_sc, *tab);
                if (Ke) {
                    fa_prerope_tile_rel(pr, w.ik2, DK, n, Ke, rope_sc, *tab);
                }
                Qd = s.Qr;
            } else {
                if (!rope_step) {
                    fa_rope_fill(pr, pr.freqs + w.ik2*hd, 1, 1.0f, rope_c1, rope_s1);
                    rope_step = true;
                }
                fa_prerope_tile(pr, w.ik2, DK, tp, n, s.Kf, rope_cs, rope_c1, rope_s1, rope_sc);
                if (Ke) {
                    fa_prerope_tile(pr, w.ik2, DK, tp, n, Ke, rope_cs, rope_c1, rope_s1, rope_sc);
                }
            }
        }
        if (R >= FA_GEMM_ROWS) {
            for (int64_t t = 0; t < n; ++t) {
                for (int64_t d = 0; d < DK; ++d) {
                    s.Kt[d*n + t] = s.Kf[t*DK + d];
                }
            }
            memset(s.S, 0, R*n*sizeof(float));
            simd_gemm(s.S, s.Q, s.Kt, (int) R, (int) DK, (int) n);
        } else {
            fa_dots(Qd, R, DK, s.Kf, n, s.S);
        }
        // mixed window cells: the exact score for the queries whose window holds the cell
        for (int m = 0; m < n_mixed; ++m) {
            const int32_t t = wmixed[m];
            for (int64_t r = 0; r < R; ++r) {
                if (win_qpos[w.j0 + r/G] <= win_last[ic + t]) {
                    float d = 0.0f;
                    ggml_vec_dot_f32((int) DK, &d, 0, Qd + r*DK, 0, Ke + t*DK, 0, 1);
                    s.S[r*n + t] = d;
                }
            }
        }
        if (pr.centred) {
            fa_centred_bias(cen, kpos + ic, R, n, s.ccoef, s.cexact, s.S);
        }

        // softcap, mask, online softmax; P overwrites S
        for (int64_t r = 0; r < R; ++r) {
            float * sr = s.S + r*n;
            if (softcap != 0.0f) {
                for (int64_t t = 0; t < n; ++t) {
                    sr[t] = softcap*tanhf(sr[t]);
                }
            }
            if (mask) {
                const float sl = s.slope[r];
                const float * mr;
                if (mask_per_head) {
                    const int64_t h = w.ik2*G + r % G;
                    const ggml_fp16_t * mp = (const ggml_fp16_t *) ((const char *) mask->data + (w.j0 + r/G)*mask->nb[1]
                                                                    + (h % mask->ne[2])*mask->nb[2] + (w.iq3 % mask->ne[3])*mask->nb[3]) + ic;
                    ggml_cpu_fp16_to_fp32(mp, s.mask, n);
                    mr = s.mask;
                } else {
                    mr = s.mask + (r/G)*FA_TILE_KV;
                }
                if (sl == 1.0f) {
                    ggml_vec_add_f32((int) n, sr, sr, mr);
                } else {
                    for (int64_t t = 0; t < n; ++t) {
                        sr[t] += sl*mr[t];
                    }
                }
            }
            const float tile_max = fa_max(sr, n);
            if (tile_max == -INFINITY) {
                memset(sr, 0, n*sizeof(float));
                continue;
            }
            const float m_new = std::max(s.M[r], tile_max);
            if (m_new > s.M[r]) {
                const float ms = expf(s.M[r] - m_new);
                ggml_vec_scale_f32((int) DV, s.O + r*DV, ms);
                s.L[r] *= ms;
                s.M[r] = m_new;
            }
            s.L[r] += (float) ggml_vec_soft_max_f32((int) n, sr, sr, m_new);
        }

        // V tile -> f32, O += P·V
        for (int64_t t = 0; t < n; ++t) {
            v_to_float((const char *) v->data + (ic + t)*v->nb[1] + w.ik2*v->nb[2] + iv3*v->nb[3], s.Vf + t*DV, DV);
        }
        fa_window_rows(pr, wrow, n, pr.win_v0 + w.ik2*DV, DV, s.Vf);
        simd_gemm(s.O, s.S, s.Vf, (int) R, (int) n, (int) DV);
        // mixed window cells: the queries whose window holds the cell read its exact V (O += p·(v_exact - v))
        for (int m = 0; m < n_mixed; ++m) {
            const int32_t t = wmixed[m];
            win_vd.resize(DV);
            fa_window_row(pr, wp[t], pr.win_v0 + w.ik2*DV, DV, win_vd.data());
            for (int64_t d = 0; d < DV; ++d) {
                win_vd[d] -= s.Vf[t*DV + d];
            }
            for (int64_t r = 0; r < R; ++r) {
                if (win_qpos[w.j0 + r/G] <= win_last[ic + t] && s.S[r*n + t] != 0.0f) {
                    ggml_vec_mad_f32((int) DV, s.O + r*DV, win_vd.data(), s.S[r*n + t]);
                }
            }
        }
    }
}

// attention sinks (one extra logit per head, no value), then O/L into dst
void fa_finish_row(const ggml_tensor * dst, int64_t iq1, int64_t h, int64_t iq3, float M, float L, float * O) {
    const ggml_tensor * sinks = dst->src[4];
    const int64_t DV = dst->ne[0];
    if (sinks) {
        const float sv = ((const float *) sinks->data)[h];
        if (sv > M) {
            const float ms = expf(M - sv);
            ggml_vec_scale_f32((int) DV, O, ms);
            L = L*ms + 1.0f;
        } else {
            L += expf(sv - M);
        }
    }
    ggml_vec_scale_f32((int) DV, O, L == 0.0f ? 0.0f : 1.0f/L);
    // dst is permuted (0, 2, 1, 3): head-major within a token
    memcpy((char *) dst->data + (iq3*dst->ne[2]*dst->ne[1] + h + iq1*dst->ne[1])*dst->nb[1], O, DV*sizeof(float));
}

} // namespace

static bool fa_supported(const ggml_tensor * dst);

bool ggml_kvq_fattn_supported(const ggml_tensor * dst, bool use_ref) {
    // use_ref (test-backend-ops' CPU reference) asks for upstream's per-row loop, which reads every cache
    // type through its type traits, an independent check of this file. It ignores src[5..8], though: a
    // pre-RoPE K cache is read here even then (on 2026-11-24 that made every pre-RoPE CUDA case "fail"
    // against a reference that attended to the raw cached values)
    const bool prerope = ggml_kvq_fa_get_prerope(dst, nullptr, nullptr, nullptr, nullptr);
    if (use_ref && !prerope) {
        return false;
    }
    const bool ok = fa_supported(dst);
    // upstream's kernels ignore src[5..8]: they would read a pre-RoPE cache as if rotated
    if (!ok && prerope) {
        GGML_ABORT("pre-RoPE K cache: flash attention with Q %s, K %s, V %s, mask %s is not supported by pykvq's CPU kernel",
                   ggml_type_name(dst->src[0]->type), ggml_type_name(dst->src[1]->type), ggml_type_name(dst->src[2]->type),
                   dst->src[3] ? ggml_type_name(dst->src[3]->type) : "none");
    }
    return ok;
}

static bool fa_supported(const ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    const fa_mode mode = fa_env_mode();
    // a pre-RoPE K cache is only readable here (ggml_kvq_fattn_supported aborts on what this does not take)
    const bool prerope = ggml_kvq_fa_get_prerope(dst, nullptr, nullptr, nullptr, nullptr);
    if ((mode == FA_OFF && !prerope) || q->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32) {
        return false;
    }
    const bool plain_k = !prerope && (k->type == GGML_TYPE_F16 || k->type == GGML_TYPE_F32);
    // f16/f32 prefill stays on upstream's tiled path. Decode (few query rows) comes here: upstream's
    // per-row path accumulates V in f16 with ggml_vec_mad_f16, whose SIMD loop covers multiples of
    // GGML_F16_STEP only (128 with AVX512-FP16), so head dims 64/96 run scalar with table lookups.
    if (plain_k && k->type == v->type && mode != FA_ALL && q->ne[1] >= FA_F16_DECODE_ROWS) {
        return false;
    }
    if (!fa_to_float(k->type, true) || !fa_to_float(v->type, false)) {
        return false;
    }
    if (q->ne[2] % k->ne[2] != 0 || q->ne[3] % k->ne[3] != 0 || q->ne[3] % v->ne[3] != 0 || k->ne[2] != v->ne[2]) {
        return false;
    }
    const ggml_tensor * mask = dst->src[3];
    if (mask && mask->type != GGML_TYPE_F16) {
        return false;
    }
    return true;
}

size_t ggml_kvq_fattn_work_size(const ggml_tensor * dst, int n_threads) {
    if (!ggml_kvq_fattn_supported(dst, false)) {
        return 0;
    }
    const fa_plan p = fa_make_plan(dst, n_threads);
    return sizeof(float)*(p.scratch*n_threads + p.partials);
}

void ggml_kvq_fattn(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    const int ith = params->ith;
    const int nth = params->nth;

    const fa_plan p = fa_make_plan(dst, nth);
    GGML_ASSERT(params->wsize >= sizeof(float)*(p.scratch*nth + p.partials));

    const ggml_to_float_t k_to_float = fa_to_float(k->type, true);
    const ggml_to_float_t v_to_float = fa_to_float(v->type, false);

    const bool match = fa_env_mode() == FA_MATCH;
    const fa_prerope pr = fa_prerope_of(dst);

    float * wdata    = (float *) params->wdata;
    float * partials = wdata + p.scratch*nth;
    const fa_scratch s = fa_scratch_at(p, wdata + p.scratch*ith);
    const int64_t n_kv    = k->ne[1];
    const int64_t n_items = p.n_units*p.n_chunks;
    const size_t  psize   = 2 + p.DV;   // M, L, O per row

    // items are handed out dynamically: units differ in work when the mask skips tiles
    if (ith == 0) {
        ggml_threadpool_chunk_set(params->threadpool, nth);
    }
    ggml_barrier(params->threadpool);

    for (int64_t it = ith; it < n_items; it = ggml_threadpool_chunk_add(params->threadpool, 1)) {
        const int64_t u   = it / p.n_chunks;
        const int64_t c   = it % p.n_chunks;
        const fa_unit w   = fa_unit_at(p, q, u);
        const int64_t ic0 = c*p.chunk;
        const int64_t ic1 = std::min(n_kv, ic0 + p.chunk);
        fa_run_item(p, dst, w, ic0, ic1, s, k_to_float, v_to_float, match, pr);

        for (int64_t r = 0; r < w.R; ++r) {
            const int64_t iq1 = w.j0 + r / p.G;
            const int64_t h   = w.ik2*p.G + r % p.G;
            if (p.n_chunks == 1) {
                fa_finish_row(dst, iq1, h, w.iq3, s.M[r], s.L[r], s.O + r*p.DV);
            } else {
                float * pr = partials + ((u*p.n_chunks + c)*p.R + r)*psize;
                pr[0] = s.M[r];
                pr[1] = s.L[r];
                memcpy(pr + 2, s.O + r*p.DV, p.DV*sizeof(float));
            }
        }
    }

    if (p.n_chunks == 1) {
        return;
    }

    // merge the chunks of each (unit, row)
    ggml_barrier(params->threadpool);
    float * O = s.O;
    for (int64_t ur = ith; ur < p.n_units*p.R; ur += nth) {
        const int64_t u = ur / p.R;
        const int64_t r = ur % p.R;
        const fa_unit w = fa_unit_at(p, q, u);
        if (r >= w.R) {
            continue;
        }
        float M = -INFINITY, L = 0.0f;
        memset(O, 0, p.DV*sizeof(float));
        for (int64_t c = 0; c < p.n_chunks; ++c) {
            const float * pr = partials + ((u*p.n_chunks + c)*p.R + r)*psize;
            if (pr[1] == 0.0f) {
                continue;
            }
            const float m_new = std::max(M, pr[0]);
            const float a = expf(M - m_new);
            const float b = expf(pr[0] - m_new);
            ggml_vec_scale_f32((int) p.DV, O, a);
            ggml_vec_mad_f32((int) p.DV, O, pr + 2, b);
            L = L*a + pr[1]*b;
            M = m_new;
        }
        fa_finish_row(dst, w.j0 + r / p.G, w.ik2*p.G + r % p.G, w.iq3, M, L, O);
    }
}
