// CPU kernels for tcq3_64 / tcq2_64 and tcq3_128 / tcq2_128 (native/ggml/tcq.c has the references): the path search
// of a write with the states in eight lanes and a read-back that takes the levels' two tables of 16 by byte shuffles
// (AVX2; both bit for bit the reference's, which other targets run), and K·Q against q8_0 through the read-back
// values.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "ggml-kvq-cpu.h"
#include "../tcq-tables.h"

#include <math.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// ggml's block_q8_0 (ggml-common.h), restated so this file builds standalone in the tests
typedef struct {
    uint16_t d;
    int8_t   qs[32];
} tcq_q8_0;
GGML_KVQ_STATIC_ASSERT(sizeof(tcq_q8_0) == 34, "block_q8_0 size");

#if defined(__AVX2__)
// rows r[j] (j = 0..7) -> c[j] whose lane m is r[m]'s element j
static inline void tcq_transpose8(const __m256 r[8], __m256 c[8]) {
    __m256 u[8], w[8];
    for (int j = 0; j < 8; j += 2) {
        u[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        u[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
        w[j]     = _mm256_shuffle_ps(u[j],     u[j + 2], 0x44);
        w[j + 1] = _mm256_shuffle_ps(u[j],     u[j + 2], 0xEE);
        w[j + 2] = _mm256_shuffle_ps(u[j + 1], u[j + 3], 0x44);
        w[j + 3] = _mm256_shuffle_ps(u[j + 1], u[j + 3], 0xEE);
    }
    for (int j = 0; j < 4; ++j) {
        c[j]     = _mm256_permute2f128_ps(w[j], w[j + 4], 0x20);
        c[j + 4] = _mm256_permute2f128_ps(w[j], w[j + 4], 0x31);
    }
}

// the least of n candidate vectors c[0..n) lane by lane, and which (the first of equals)
static inline void tcq_min_arg(const __m256 * c, int n, float * minc, int32_t * arg) {
    __m256 b = c[0];
    __m256i bj = _mm256_setzero_si256();
    for (int j = 1; j < n; ++j) {
        const __m256 lt = _mm256_cmp_ps(c[j], b, _CMP_LT_OQ);
        b = _mm256_blendv_ps(b, c[j], lt);
        bj = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bj), _mm256_castsi256_ps(_mm256_set1_epi32(j)), lt));
    }
    _mm256_store_ps(minc, b);
    _mm256_store_si256((__m256i *) arg, bj);
}

// ggml_kvq_tcq_viterbi_t (native/ggml/tcq.c's tcq_viterbi) with the 256 states in eight lanes: the same float
// operations in the same order, so the same states. A state's predecessors are K = 2^k consecutive states (k by the
// step's parity: 2, 3 or 4); their least cost is taken by transposing K vectors of them so that each lane holds one
// group and comparing in order (strictly less: the first of equals). The new costs read those minima in order (state
// s takes group s & ml).
static void tcq_viterbi_avx2(const float * z, int n, const int kk[2], const float * lut, int o, int rot, uint8_t * st) {
    const int k0 = kk[0], ml0 = (1 << (8 - k0)) - 1;
    float cost[256] __attribute__((aligned(32)));
    float minc[64] __attribute__((aligned(32)));
    int32_t arg[64] __attribute__((aligned(32)));
    uint8_t bp[QK_TCQ][64];
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 inf = _mm256_set1_ps(INFINITY);
    {
        const __m256 z0 = _mm256_set1_ps(z[rot % n]);
        for (int v = 0; v < 256; v += 8) {
            const __m256 e = _mm256_sub_ps(z0, _mm256_loadu_ps(lut + v));
            __m256 c = _mm256_mul_ps(e, e);
            if (o >= 0) {
                const __m256i sv = _mm256_add_epi32(_mm256_set1_epi32(v), iota);
                const __m256i ok = _mm256_cmpeq_epi32(_mm256_and_si256(sv, _mm256_set1_epi32(ml0)), _mm256_set1_epi32(o));
                c = _mm256_blendv_ps(inf, c, _mm256_castsi256_ps(ok));
            }
            _mm256_store_ps(cost + v, c);
        }
    }
    const __m256i perm4 = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 1; i < n; ++i) {
        const int k = kk[i & 1], ml = (1 << (8 - k)) - 1, ng = ml + 1;
        const float * li = lut + 256*(i & 1);
        if (k == 2) {              // groups of 4: eight per 32 costs, a 4 x 4 transpose in each 128-bit lane
            for (int g = 0; g < 8; ++g) {
                const float * c = cost + 32*g;
                const __m256 a0 = _mm256_load_ps(c), a1 = _mm256_load_ps(c + 8), a2 = _mm256_load_ps(c + 16), a3 = _mm256_load_ps(c + 24);
                const __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1);
                const __m256 t2 = _mm256_unpacklo_ps(a2, a3), t3 = _mm256_unpackhi_ps(a2, a3);
                const __m256 cj[4] = { _mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                                       _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE) };
                __m256 b = cj[0];
                __m256i bj = _mm256_setzero_si256();
                for (int j = 1; j < 4; ++j) {
                    const __m256 lt = _mm256_cmp_ps(cj[j], b, _CMP_LT_OQ);
                    b = _mm256_blendv_ps(b, cj[j], lt);
                    bj = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bj), _mm256_castsi256_ps(_mm256_set1_epi32(j)), lt));
                }
                // lanes hold groups 0, 2, 4, 6 | 1, 3, 5, 7 of these eight
                _mm256_store_ps(minc + 8*g, _mm256_permutevar8x32_ps(b, perm4));
                _mm256_store_si256((__m256i *) (arg + 8*g), _mm256_permutevar8x32_epi32(bj, perm4));
            }
        } else if (k == 3) {       // groups of 8: an 8 x 8 transpose per eight groups
            for (int g = 0; g < 4; ++g) {
                __m256 r[8], cj[8];
                for (int j = 0; j < 8; ++j) {
                    r[j] = _mm256_load_ps(cost + 64*g + 8*j);
                }
                tcq_transpose8(r, cj);
                tcq_min_arg(cj, 8, minc + 8*g, arg + 8*g);
            }
        } else {                   // k == 4 (tcq35_64's even steps), groups of 16: members 0-7 and 8-15 transposed apart
            for (int g = 0; g < 2; ++g) {
                __m256 lo[8], hi[8], cj[16];
                for (int m = 0; m < 8; ++m) {
                    lo[m] = _mm256_load_ps(cost + 128*g + 16*m);
                    hi[m] = _mm256_load_ps(cost + 128*g + 16*m + 8);
                }
                tcq_transpose8(lo, cj);
                tcq_transpose8(hi, cj + 8);
                tcq_min_arg(cj, 16, minc + 8*g, arg + 8*g);
            }
        }
        for (int m = 0; m < ng; ++m) {
            bp[i][m] = (uint8_t) arg[m];
        }
        const __m256 zi = _mm256_set1_ps(z[(i + rot) % n]);
        for (int v = 0; v < 256; v += 8) {
            const __m256 e = _mm256_sub_ps(zi, _mm256_loadu_ps(li + v));
            _mm256_store_ps(cost + v, _mm256_add_ps(_mm256_load_ps(minc + (v & ml)), _mm256_mul_ps(e, e)));
        }
    }
    int s = -1;
    float b = INFINITY;
    for (int q = 0; q < 256; ++q) {
        if ((o < 0 || (q >> k0) == o) && (s < 0 || cost[q] < b)) {
            b = cost[q];
            s = q;
        }
    }
    st[n - 1] = (uint8_t) s;
    for (int i = n - 1; i > 0; --i) {
        const int k = kk[i & 1];
        s = ((s << k) & 0xFF) | bp[i][s & ((1 << (8 - k)) - 1)];
        st[i - 1] = (uint8_t) s;
    }
}
#endif

void quantize_row_tcq3_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    ggml_kvq_quantize_row_tcq_with(GGML_TYPE_TCQ3_64, x, y, k, tcq_viterbi_avx2);
#else
    quantize_row_tcq3_64_ref(x, (block_tcq3_64 *) y, k);
#endif
}

void quantize_row_tcq2_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    ggml_kvq_quantize_row_tcq_with(GGML_TYPE_TCQ2_64, x, y, k, tcq_viterbi_avx2);
#else
    quantize_row_tcq2_64_ref(x, (block_tcq2_64 *) y, k);
#endif
}

void quantize_row_tcq3_128(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    ggml_kvq_quantize_row_tcq_with(GGML_TYPE_TCQ3_128, x, y, k, tcq_viterbi_avx2);
#else
    quantize_row_tcq3_128_ref(x, (block_tcq3_128 *) y, k);
#endif
}

void quantize_row_tcq2_128(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    ggml_kvq_quantize_row_tcq_with(GGML_TYPE_TCQ2_128, x, y, k, tcq_viterbi_avx2);
#else
    quantize_row_tcq2_128_ref(x, (block_tcq2_128 *) y, k);
#endif
}

#if defined(__AVX2__)
// the levels of 16 states times d: A[s >> 4] + B[s & 15] by byte shuffles of the tables' low and high bytes, in int16
// (|A| + |B| < 2^15), times d/4096 (exact: a power of two; so the same product as the reference's d * (level/4096))
static inline void tcq_levels16(__m128i s, const __m128i tab[4], __m256 d4096, float * y) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(s, 4), m4), lo = _mm_and_si128(s, m4);
    const __m128i al = _mm_shuffle_epi8(tab[0], hi), ah = _mm_shuffle_epi8(tab[1], hi);
    const __m128i bl = _mm_shuffle_epi8(tab[2], lo), bh = _mm_shuffle_epi8(tab[3], lo);
    const __m128i l0 = _mm_add_epi16(_mm_unpacklo_epi8(al, ah), _mm_unpacklo_epi8(bl, bh));
    const __m128i l1 = _mm_add_epi16(_mm_unpackhi_epi8(al, ah), _mm_unpackhi_epi8(bl, bh));
    _mm256_storeu_ps(y,     _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(l0)), d4096));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(l1)), d4096));
}

// 32 values of a 2-bit stream: for j = 4q + r (q = 0 .. 7), the state is the byte pair (e0[q], e1[q]) shifted by
// 2r + 2, e0 / e1 the stream's bytes q - 1 / q (around the stream for q = 0)
static inline void tcq2_values32(__m128i e0, __m128i e1, const __m128i tab[4], __m256 d4096, float * y) {
    const __m128i ff = _mm_set1_epi16(0xFF);
    const __m128i w = _mm_unpacklo_epi8(e0, e1);
    const __m128i s0 = _mm_and_si128(_mm_srli_epi16(w, 2), ff), s1 = _mm_and_si128(_mm_srli_epi16(w, 4), ff);
    const __m128i s2 = _mm_and_si128(_mm_srli_epi16(w, 6), ff), s3 = _mm_srli_epi16(w, 8);
    const __m128i p01l = _mm_unpacklo_epi16(s0, s1), p23l = _mm_unpacklo_epi16(s2, s3);
    const __m128i p01h = _mm_unpackhi_epi16(s0, s1), p23h = _mm_unpackhi_epi16(s2, s3);
    tcq_levels16(_mm_packus_epi16(_mm_unpacklo_epi32(p01l, p23l), _mm_unpackhi_epi32(p01l, p23l)), tab, d4096, y);
    tcq_levels16(_mm_packus_epi16(_mm_unpacklo_epi32(p01h, p23h), _mm_unpackhi_epi32(p01h, p23h)), tab, d4096, y + 16);
}

// n (32 or 64) values of a 2-bit stream, 32 at a time: the first reach back around the stream to its last byte
static inline void tcq2_values(const uint8_t * qs, int n, const __m128i tab[4], __m256 d4096, float * y) {
    const __m128i q0 = _mm_loadl_epi64((const __m128i *) qs);
    tcq2_values32(_mm_or_si128(_mm_slli_epi64(q0, 8), _mm_cvtsi32_si128(qs[n/4 - 1])), q0, tab, d4096, y);
    if (n == 64) {
        tcq2_values32(_mm_loadl_epi64((const __m128i *) (qs + 7)), _mm_loadl_epi64((const __m128i *) (qs + 8)), tab, d4096, y + 32);
    }
}

// n (32 or 64) values of a 3-bit stream, sixteen at a time: value j's state is bits (3j + 3) % 8 .. + 7 of the byte pair
// at (3j + 3) / 8 of e = (the stream's last byte, the stream). Sixteen values span 6 bytes, so one byte shuffle of a
// group's 8 bytes gathers every value's pair into a 16-bit lane, and a multiply by 2^(8 - shift) leaves its window in
// the lane's high byte.
static inline void tcq3_values(const uint8_t * qs, int n, const __m128i tab[4], __m256 d4096, float * y) {
    const __m256i idx = _mm256_setr_epi8(0, 1, 0, 1, 1, 2, 1, 2, 1, 2, 2, 3, 2, 3, 3, 4,
                                         3, 4, 3, 4, 4, 5, 4, 5, 4, 5, 5, 6, 5, 6, 6, 7);
    const __m256i mul = _mm256_setr_epi16(32, 4, 128, 16, 2, 64, 8, 256, 32, 4, 128, 16, 2, 64, 8, 256);
    for (int g = 0; g < n/16; ++g) {       // values 16g .. 16g + 15: bytes 6g .. 6g + 6 of e (the 8th is multiplied out)
        const __m128i e = g == 0 ? _mm_or_si128(_mm_slli_epi64(_mm_loadl_epi64((const __m128i *) qs), 8), _mm_cvtsi32_si128(qs[n*3/8 - 1]))
                                 : _mm_srli_epi64(_mm_loadl_epi64((const __m128i *) (qs + 6*g - 2)), 8);
        const __m256i src = _mm256_broadcastsi128_si256(e);
        const __m256i w = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(src, idx), mul), 8);
        tcq_levels16(_mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)), tab, d4096, y + 16*g);
    }
}

// the levels of 16 states times d as tcq_levels16 takes them, the even states' from tab_e and the odd ones' from tab_o
// (both lookups, then a byte blend)
static inline void tcq_levels16_alt(__m128i s, const __m128i tab_e[4], const __m128i tab_o[4], __m256 d4096, float * y) {
    const __m128i m4 = _mm_set1_epi8(0x0F), odd = _mm_set1_epi16((short) 0xFF00);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(s, 4), m4), lo = _mm_and_si128(s, m4);
    __m128i t[4];
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm_blendv_epi8(_mm_shuffle_epi8(tab_e[i], i < 2 ? hi : lo), _mm_shuffle_epi8(tab_o[i], i < 2 ? hi : lo), odd);
    }
    const __m128i l0 = _mm_add_epi16(_mm_unpacklo_epi8(t[0], t[1]), _mm_unpacklo_epi8(t[2], t[3]));
    const __m128i l1 = _mm_add_epi16(_mm_unpackhi_epi8(t[0], t[1]), _mm_unpackhi_epi8(t[2], t[3]));
    _mm256_storeu_ps(y,     _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(l0)), d4096));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(l1)), d4096));
}

// tcq25_64's 64 values, sixteen at a time as tcq3_values does: value 16g + r's window starts at bit 40g + e_r of e =
// (the stream's last byte, the stream), e_r = 3, 5, 8, 10, ... (5 bits a pair of values); each group reads bytes 5g ..
// 5g + 5 of e. Even values read the 3-bit steps' tables, odd ones the 2-bit steps' (a byte blend of both lookups).
static inline void tcq25_values(const uint8_t * qs, const __m128i tab3[4], const __m128i tab2[4], __m256 d4096, float * y) {
    const __m256i idx = _mm256_setr_epi8(0, 1, 0, 1, 1, 2, 1, 2, 1, 2, 1, 2, 2, 3, 2, 3,
                                         2, 3, 3, 4, 3, 4, 3, 4, 4, 5, 4, 5, 4, 5, 5, 6);
    const __m256i mul = _mm256_setr_epi16(32, 8, 256, 64, 8, 2, 64, 16, 2, 128, 16, 4, 128, 32, 4, 256);
    for (int g = 0; g < 4; ++g) {
        const __m128i e = g == 0 ? _mm_or_si128(_mm_slli_epi64(_mm_loadl_epi64((const __m128i *) qs), 8), _mm_cvtsi32_si128(qs[19]))
                                 : _mm_srli_epi64(_mm_loadl_epi64((const __m128i *) (qs + 5*g - 3)), 16);
        const __m256i w = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(e), idx), mul), 8);
        tcq_levels16_alt(_mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)), tab3, tab2, d4096, y + 16*g);
    }
}

// tcq35_64's 64 values, sixteen at a time: value 16g + r's window starts at bit 56g + e_r of e = (the stream's last
// byte, the stream), e_r = 4, 7, 11, 14, ... (7 bits a pair of values), so each group reads bytes 7g .. 7g + 8 of e
// (16-byte loads that stay inside the block, shifted); the levels as tcq25_values takes them
static inline void tcq35_values(const uint8_t * qs, const __m128i tab4[4], const __m128i tab3[4], __m256 d4096, float * y) {
    const __m256i idx = _mm256_setr_epi8(0, 1, 0, 1, 1, 2, 1, 2, 2, 3, 2, 3, 3, 4, 3, 4,
                                         4, 5, 4, 5, 4, 5, 5, 6, 5, 6, 6, 7, 6, 7, 7, 8);
    const __m256i mul = _mm256_setr_epi16(16, 2, 32, 4, 64, 8, 128, 16, 256, 32, 2, 64, 4, 128, 8, 256);
    const __m128i tail = _mm_loadu_si128((const __m128i *) (qs + 12));                 // bytes 12 .. 27
    const __m128i e[4] = { _mm_or_si128(_mm_slli_si128(_mm_loadu_si128((const __m128i *) qs), 1), _mm_cvtsi32_si128(qs[27])),
                           _mm_loadu_si128((const __m128i *) (qs + 6)),                 // e's bytes 7 ..: qs[6 ..]
                           _mm_srli_si128(tail, 1),                                     // 14 ..: qs[13 ..]
                           _mm_srli_si128(tail, 8) };                                   // 21 ..: qs[20 .. 27], 0
    for (int g = 0; g < 4; ++g) {
        const __m256i w = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(e[g]), idx), mul), 8);
        tcq_levels16_alt(_mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)), tab4, tab3, d4096, y + 16*g);
    }
}

// A's and B's low and high bytes, as shuffle tables (constants: the FA loop reads a row at a time), for value j of a
// run (tcq25_64's and tcq35_64's depend on its parity)
static inline void tcq_shuffle_tables(enum ggml_type type, int j, __m128i tab[4]) {
    static const uint8_t b3[4][16] = { { TCQ3_A(TCQ_LO) }, { TCQ3_A(TCQ_HI) }, { TCQ3_B(TCQ_LO) }, { TCQ3_B(TCQ_HI) } };
    static const uint8_t b2[4][16] = { { TCQ2_A(TCQ_LO) }, { TCQ2_A(TCQ_HI) }, { TCQ2_B(TCQ_LO) }, { TCQ2_B(TCQ_HI) } };
    static const uint8_t b25[2][4][16] = { { { TCQ25_A3(TCQ_LO) }, { TCQ25_A3(TCQ_HI) }, { TCQ25_B3(TCQ_LO) }, { TCQ25_B3(TCQ_HI) } },
                                           { { TCQ25_A2(TCQ_LO) }, { TCQ25_A2(TCQ_HI) }, { TCQ25_B2(TCQ_LO) }, { TCQ25_B2(TCQ_HI) } } };
    static const uint8_t b35[2][4][16] = { { { TCQ35_A4(TCQ_LO) }, { TCQ35_A4(TCQ_HI) }, { TCQ35_B4(TCQ_LO) }, { TCQ35_B4(TCQ_HI) } },
                                           { { TCQ35_A3(TCQ_LO) }, { TCQ35_A3(TCQ_HI) }, { TCQ35_B3(TCQ_LO) }, { TCQ35_B3(TCQ_HI) } } };
    const uint8_t (*b)[16] = type == GGML_TYPE_TCQ25_64 ? b25[j & 1] : type == GGML_TYPE_TCQ35_64 ? b35[j & 1]
                           : ggml_kvq_tcq_bits(type, j) == 3 ? b3 : b2;
    for (int i = 0; i < 4; ++i) {
        tab[i] = _mm_loadu_si128((const __m128i *) b[i]);
    }
}
#endif

#if defined(__AVX2__)
// rows of blocks of (scale bytes) + qk*(k_even + k_odd)/16 bytes: each run of 64's states, then its levels with the
// block's scale (tcq25_64 / tcq35_64: blocks of one run)
static void tcq_dequantize_rows(enum ggml_type type, const uint8_t * x, float * y, int64_t k) {
    const int bits = ggml_kvq_tcq_bits(type, 0) + ggml_kvq_tcq_bits(type, 1), qk = ggml_kvq_tcq_block(type);
    const int sb = ggml_kvq_tcq_scale_bytes(type);
    const size_t bs = ggml_kvq_tcq_block_bytes(type);
    __m128i tab[4], tab_odd[4];
    tcq_shuffle_tables(type, 0, tab);
    tcq_shuffle_tables(type, 1, tab_odd);
    for (int64_t i = 0; i < k/qk; ++i) {
        const uint8_t * b = x + i*bs;
        const __m256 d4096 = _mm256_set1_ps(ggml_kvq_tcq_scale_read(b, sb)*(1.0f/4096));
        for (int r = 0; r < qk; r += QK_TCQ) {
            if (bits == 7) {
                tcq35_values(b + sb, tab, tab_odd, d4096, y + i*qk);
            } else if (bits == 5) {
                tcq25_values(b + sb, tab, tab_odd, d4096, y + i*qk);
            } else if (bits == 4) {
                tcq2_values(b + sb + r*2/8, QK_TCQ, tab, d4096, y + i*qk + r);
            } else {
                tcq3_values(b + sb + r*3/8, QK_TCQ, tab, d4096, y + i*qk + r);
            }
        }
    }
}
#endif

void dequantize_row_tcq3_64_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    tcq_dequantize_rows(GGML_TYPE_TCQ3_64, (const uint8_t *) x, y, k);
#else
    dequantize_row_tcq3_64((const block_tcq3_64 *) x, y, k);
#endif
}

void dequantize_row_tcq2_64_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    tcq_dequantize_rows(GGML_TYPE_TCQ2_64, (const uint8_t *) x, y, k);
#else
    dequantize_row_tcq2_64((const block_tcq2_64 *) x, y, k);
#endif
}

// the read-back values of each block of qk (64 or 128) against q8_0's blocks of 32
static float tcq_dot_q8_0(int n, int qk, const void * vx, size_t bsize, ggml_to_float_t to_float, const tcq_q8_0 * y) {
    float sum = 0.0f;
    for (int i = 0; i < n/qk; ++i) {
        float v[QK_TCQ128];
        to_float((const char *) vx + i*bsize, v, qk);
        for (int h = 0; h < qk/32; ++h) {
            float s = 0.0f;
            for (int j = 0; j < 32; ++j) {
                s += v[32*h + j]*(float) y[qk/32*i + h].qs[j];
            }
            sum += s*ggml_kvq_fp16_to_fp32(y[qk/32*i + h].d);
        }
    }
    return sum;
}

void ggml_vec_dot_tcq3_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                               const void * GGML_RESTRICT vy, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
    *s = tcq_dot_q8_0(n, QK_TCQ, vx, sizeof(block_tcq3_64), dequantize_row_tcq3_64_cpu, (const tcq_q8_0 *) vy);
}

void ggml_vec_dot_tcq2_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                               const void * GGML_RESTRICT vy, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
    *s = tcq_dot_q8_0(n, QK_TCQ, vx, sizeof(block_tcq2_64), dequantize_row_tcq2_64_cpu, (const tcq_q8_0 *) vy);
}

void dequantize_row_tcq3_128_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    tcq_dequantize_rows(GGML_TYPE_TCQ3_128, (const uint8_t *) x, y, k);
#else
    dequantize_row_tcq3_128((const block_tcq3_128 *) x, y, k);
#endif
}

void dequantize_row_tcq2_128_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    tcq_dequantize_rows(GGML_TYPE_TCQ2_128, (const uint8_t *) x, y, k);
#else
    dequantize_row_tcq2_128((const block_tcq2_128 *) x, y, k);
#endif
}

void quantize_row_tcq25_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    ggml_kvq_quantize_row_tcq_with(GGML_TYPE_TCQ25_64, x, y, k, tcq_viterbi_avx2);
#else
    quantize_row_tcq25_64_ref(x, (block_tcq25_64 *) y, k);
#endif
}

void dequantize_row_tcq25_64_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    tcq_dequantize_rows(GGML_TYPE_TCQ25_64, (const uint8_t *) x, y, k);
#else
    dequantize_row_tcq25_64((const block_tcq25_64 *) x, y, k);
#endif
}

void ggml_vec_dot_tcq25_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                const void * GGML_RESTRICT vy, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
    *s = tcq_dot_q8_0(n, QK_TCQ, vx, sizeof(block_tcq25_64), dequantize_row_tcq25_64_cpu, (const tcq_q8_0 *) vy);
}

void quantize_row_tcq35_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    ggml_kvq_quantize_row_tcq_with(GGML_TYPE_TCQ35_64, x, y, k, tcq_viterbi_avx2);
#else
    quantize_row_tcq35_64_ref(x, (block_tcq35_64 *) y, k);
#endif
}

void dequantize_row_tcq35_64_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    tcq_dequantize_rows(GGML_TYPE_TCQ35_64, (const uint8_t *) x, y, k);
#else
    dequantize_row_tcq35_64((const block_tcq35_64 *) x, y, k);
#endif
}

void ggml_vec_dot_tcq35_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                const void * GGML_RESTRICT vy, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
    *s = tcq_dot_q8_0(n, QK_TCQ, vx, sizeof(block_tcq35_64), dequantize_row_tcq35_64_cpu, (const tcq_q8_0 *) vy);
}

void ggml_vec_dot_tcq3_128_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                const void * GGML_RESTRICT vy, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
    *s = tcq_dot_q8_0(n, QK_TCQ128, vx, sizeof(block_tcq3_128), dequantize_row_tcq3_128_cpu, (const tcq_q8_0 *) vy);
}

void ggml_vec_dot_tcq2_128_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                                const void * GGML_RESTRICT vy, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
    *s = tcq_dot_q8_0(n, QK_TCQ128, vx, sizeof(block_tcq2_128), dequantize_row_tcq2_128_cpu, (const tcq_q8_0 *) vy);
}

// q4t2_64 (family Q53, its second half a 32-value tcq2 block; native/ggml/q53.c has the reference): the write with the
// SIMD scale search and path search, the read with the 2-bit stream's windows by shifts, K·Q through the read-back
void quantize_row_q4t2_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    ggml_kvq_quantize_row_q4t2_64_with(x, (block_q4t2_64 *) y, k, ggml_kvq_cpu_lsq_block, tcq_viterbi_avx2);
#else
    ggml_kvq_quantize_row_q4t2_64_with(x, (block_q4t2_64 *) y, k, ggml_kvq_cpu_lsq_block, NULL);
#endif
}

void dequantize_row_q4t2_64_cpu(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    const block_q4t2_64 * x = (const block_q4t2_64 *) vx;
    __m128i tab[4];
    tcq_shuffle_tables(GGML_TYPE_TCQ2_64, 0, tab);
    for (int64_t i = 0; i < k/QK_Q4T2; ++i) {
        const block_q4t2_64 * b = x + i;
        float * o = y + i*QK_Q4T2;
        const __m128i nib = _mm_loadu_si128((const __m128i *) b->qs4);
        const __m128i m4 = _mm_set1_epi8(15), e8 = _mm_set1_epi8(8);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(nib, m4), e8), hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(nib, 4), m4), e8);
        const __m256 d4 = _mm256_set1_ps(ggml_kvq_f16_bytes(b->d4));
        const __m128i v[2] = { lo, hi };
        for (int h = 0; h < 2; ++h) {      // values 16h .. 16h + 15
            _mm256_storeu_ps(o + 16*h,     _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v[h])), d4));
            _mm256_storeu_ps(o + 16*h + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v[h], 8))), d4));
        }
        tcq2_values(b->qs2, QK_Q4T2/2, tab, _mm256_set1_ps(ggml_kvq_tcq_scale(b->d2)*(1.0f/4096)), o + 32);
    }
#else
    dequantize_row_q4t2_64((const block_q4t2_64 *) vx, y, k);
#endif
}

void ggml_vec_dot_q4t2_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                               const void * GGML_RESTRICT vy, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
    *s = tcq_dot_q8_0(n, QK_Q4T2, vx, sizeof(block_q4t2_64), dequantize_row_q4t2_64_cpu, (const tcq_q8_0 *) vy);
}

// t32_64 (family Q53, both halves 32-value trellis blocks; native/ggml/q53.c has the reference): as q4t2_64
void quantize_row_t32_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    ggml_kvq_quantize_row_t32_64_with(x, (block_t32_64 *) y, k, tcq_viterbi_avx2);
#else
    ggml_kvq_quantize_row_t32_64_with(x, (block_t32_64 *) y, k, NULL);
#endif
}

void dequantize_row_t32_64_cpu(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__)
    const block_t32_64 * x = (const block_t32_64 *) vx;
    __m128i tab3[4], tab2[4];
    tcq_shuffle_tables(GGML_TYPE_TCQ3_64, 0, tab3);
    tcq_shuffle_tables(GGML_TYPE_TCQ2_64, 0, tab2);
    for (int64_t i = 0; i < k/QK_T32; ++i) {
        const block_t32_64 * b = x + i;
        float * o = y + i*QK_T32;
        tcq3_values(b->qs3, QK_T32/2, tab3, _mm256_set1_ps(ggml_kvq_tcq_scale(b->d3)*(1.0f/4096)), o);
        tcq2_values(b->qs2, QK_T32/2, tab2, _mm256_set1_ps(ggml_kvq_tcq_scale(b->d2)*(1.0f/4096)), o + 32);
    }
#else
    dequantize_row_t32_64((const block_t32_64 *) vx, y, k);
#endif
}

void ggml_vec_dot_t32_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx,
                              const void * GGML_RESTRICT vy, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
    *s = tcq_dot_q8_0(n, QK_T32, vx, sizeof(block_t32_64), dequantize_row_t32_64_cpu, (const tcq_q8_0 *) vy);
}
