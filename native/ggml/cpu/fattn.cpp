// CPU flash attention for quantized and mixed KV caches (the CPU dispatch seam routes
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
#include "fattn.h"

#include "simd-gemm.h"
#include "vec.h"

#include <atomic>

namespace kvq_fa {
namespace {

constexpr int FA_ROWS      = 64;   // target query rows (tokens x group heads) per unit
constexpr int FA_GEMM_ROWS = 16;   // from this many rows on, S = Q·Kᵀ is a GEMM on a transposed K tile
constexpr int FA_MIN_CHUNK = 256;  // shortest KV chunk worth a partial result
constexpr int FA_PAD       = 16;   // floats between per-thread scratch areas (one cache line)
constexpr int FA_F16_DECODE_ROWS = 16; // f16/f32 caches: batches of fewer query tokens take this path (decode)

// C += A·B (row-major, M x K times K x N) as simd_gemm, whose rows past its blocks of GEMM_RM run one at a time with
// two vectors of columns per pass: a GQA group of 3 (SmolLM2's) then runs two FMA chains and reads the V tile three
// times (simd_gemm was 7.5% of a decode in perf). Here those rows share each pass over B, with as many column vectors
// as simd_gemm's register budget leaves them (at most 4). Each element takes the same FMAs in the same order: the
// same bits.
#if defined(GGML_SIMD) && !defined(__ARM_FEATURE_SVE) && !defined(__riscv_v_intrinsic)
template <int RM>
void fa_gemm_rows(float * C, const float * A, const float * B, int K, int N) {
    constexpr int KN = GGML_F32_EPR;
    constexpr int RN = std::min(4, std::max(1, GEMM_RM*GEMM_RN/RM));
    int64_t jj = 0;
    for (; jj + RN*KN <= N; jj += RN*KN) {
        simd_gemm_ukernel<RM, RN>(C + jj, A, B + jj, K, N);
    }
    for (; jj + KN <= N; jj += KN) {
        simd_gemm_ukernel<RM, 1>(C + jj, A, B + jj, K, N);
    }
    if (jj < N) {
        simd_gemm_ukernel_tail<RM>(C + jj, A, B + jj, K, N, (int) (N - jj));
    }
}

void fa_gemm(float * C, const float * A, const float * B, int M, int K, int N) {
    static_assert(GEMM_RM <= 6, "fa_gemm takes up to 5 rows past simd_gemm's blocks");
    const int m0 = M - M % GEMM_RM;
    if (m0 > 0) {
        simd_gemm(C, A, B, m0, K, N);
    }
    C += (int64_t) m0*N;
    A += (int64_t) m0*K;
    switch (M - m0) {
        case 0:  break;
        case 1:  fa_gemm_rows<1>(C, A, B, K, N); break;
        case 2:  fa_gemm_rows<2>(C, A, B, K, N); break;
        case 3:  fa_gemm_rows<3>(C, A, B, K, N); break;
        case 4:  fa_gemm_rows<4>(C, A, B, K, N); break;
        case 5:  fa_gemm_rows<5>(C, A, B, K, N); break;
    }
}
#else
void fa_gemm(float * C, const float * A, const float * B, int M, int K, int N) {
    simd_gemm(C, A, B, M, K, N);
}
#endif

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

const char * const FA_MODE_NAMES[] = { "1", "0", "match", "all" };   // by fa_mode

int fa_mode_of(const char * name) {
    for (int i = 0; i < 4; ++i) {
        if (strcmp(name, FA_MODE_NAMES[i]) == 0) {
            return i;
        }
    }
    return -1;
}

// the process's mode: GGML_KVQ_FA read once, at the first node that asks (an unknown value: this path),
// then what ggml_kvq_cpu_set_fa_mode sets
std::atomic<int> g_fa_mode{-1};

fa_mode fa_env_mode() {
    int m = g_fa_mode.load(std::memory_order_relaxed);
    if (m < 0) {
        const char * e = getenv("GGML_KVQ_FA");
        m = e != nullptr && fa_mode_of(e) >= 0 ? fa_mode_of(e) : FA_ON;
        g_fa_mode.store(m, std::memory_order_relaxed);
    }
    return (fa_mode) m;
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

// the D values at element offset off of window row r, as floats, by the cache rows' own decoder (q8_0 rows: off
// and D are whole blocks, since a head's values start and end on one)
inline void fa_window_row(const fa_prerope & pr, int32_t r, int64_t off, int64_t D, float * out) {
    pr.win_to_float(pr.win_rows + r*pr.win_nb1 + ggml_row_size(pr.win_type, off), out, D);
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

        // K tile -> f32, then S = Q·Kᵀ (S is R x n, row stride n).
        // Cells of the exact window: their unquantized row instead (the same domain, so the same transform follows).
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
        // pre-RoPE decode over consecutive cells: keys turned by their offset in the tile (fa_rope_tab)
        const int32_t * tp = pr.on ? kpos + ic : nullptr;
        const bool rel = pr.on && !pr.centred && tab && fa_consecutive(tp, n);
        const char * k0 = (const char *) k->data + ic*k->nb[1] + w.ik2*k->nb[2] + ik3*k->nb[3];
        // q4_0 keys of a tile without window rows: decoded and turned in one pass
        const bool k_done = rel && !wrow && k->type == GGML_TYPE_Q4_0 &&
                            fa_prerope_tile_rel_q4_0(pr, w.ik2, DK, k0, k->nb[1], n, s.Kf, rope_sc, *tab);
        if (!k_done) {
            for (int64_t t = 0; t < n; ++t) {
                k_to_float(k0 + t*k->nb[1], s.Kf + t*DK, DK);
            }
            fa_window_rows(pr, wrow, n, w.ik2*DK, DK, s.Kf);
        }
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
            if (rel) {
                q_at.at(tp[0], hd, pr.freqs + w.ik2*hd, tab->c64.data(), tab->s64.data(), q_c, q_s);
                fa_rope_q_back(pr, q_c, q_s, s.Q, R, DK, s.Qr);
                if (!k_done) {
                    fa_prerope_tile_rel(pr, w.ik2, DK, n, s.Kf, rope_sc, *tab);
                }
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
            fa_gemm(s.S, s.Q, s.Kt, (int) R, (int) DK, (int) n);
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
        fa_gemm(s.O, s.S, s.Vf, (int) R, (int) n, (int) DV);
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

}  // namespace
}  // namespace kvq_fa

using namespace kvq_fa;

static bool fa_supported(const ggml_tensor * dst);

bool ggml_kvq_cpu_set_fa_mode(const char * mode) {
    const int m = mode != nullptr ? fa_mode_of(mode) : -1;
    if (m >= 0) {
        g_fa_mode.store(m, std::memory_order_relaxed);
    }
    return m >= 0;
}

const char * ggml_kvq_cpu_fa_mode(void) {
    return FA_MODE_NAMES[fa_env_mode()];
}

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
