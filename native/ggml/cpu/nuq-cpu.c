// CPU kernels for the non-uniform cache types (nuq4, nuq3, nuq2, nuq3o, nuq2o, nuq3_64, nuq2_64).
//
// K·Q runs on integers: Q is quantized to q8_0 (vec_dot_type), the K indices are
// looked up in the codebook with a byte shuffle (pshufb / tbl, like upstream's
// iq4_nl kernels), and each 32 values give one int32 dot product and one float
// scale d·d8. Block-64 types span two q8_0 blocks; those with an outlier add
// (ov - d·c[idx[oi]])·q8[oi]·d8 for the outlier.
//
// Codebooks come from the node's op_params (ggml-kvq.h): ggml_kvq_cpu_bind()
// loads them into thread-local storage before each node; quantize and vec_dot
// read slot A, to_float reads slot B, and an empty slot means the fallback.
//
// Every variant below is compiled when the target allows it and is exported
// through ggml_kvq_cpu_impl_*() so the tests check each against the reference.
#include "ggml-kvq-cpu.h"
#include "kvq-simd.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#define NUQ_VEC_DOT_ARGS int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, \
                         const void * GGML_RESTRICT vy, size_t by, int nrc
#define NUQ_UNUSED_ARGS (void) bs; (void) bx; (void) by; (void) nrc

#if defined(__GNUC__)
#define NUQ_INLINE static inline __attribute__((always_inline))
#else
#define NUQ_INLINE static inline
#endif

// ggml's block_q8_0 (ggml-common.h), restated so this file builds standalone in the tests
typedef struct {
    uint16_t d;
    int8_t   qs[32];
} nuq_q8_0;
GGML_KVQ_STATIC_ASSERT(sizeof(nuq_q8_0) == 34, "block_q8_0 size");

// f16 -> f32 for the scales (exact in every variant)
#if defined(__F16C__)
#define NUQ_H2F(h) _cvtsh_ss((unsigned short) (h))
#elif defined(__ARM_NEON) && defined(__aarch64__)
static inline float nuq_h2f_neon(uint16_t h) { __fp16 f; memcpy(&f, &h, 2); return (float) f; }
#define NUQ_H2F(h) nuq_h2f_neon(h)
#else
#define NUQ_H2F(h) ggml_kvq_fp16_to_fp32(h)
#endif
#define NUQ_D(p) NUQ_H2F((uint16_t) ((p)[0] | ((p)[1] << 8)))

//
// thread-local codebooks
//

#if defined(__GNUC__)
#define NUQ_TLS __thread __attribute__((tls_model("initial-exec")))
#else
#define NUQ_TLS _Thread_local
#endif

static NUQ_TLS struct {
    int8_t   a[GGML_KVQ_NUQ_MAX_CODES];
    int8_t   b[GGML_KVQ_NUQ_MAX_CODES];
    unsigned bits;   // bit 0: slot A present, bit 1: slot B present, bit 2: something is bound
} nuq_tl;

static const int8_t nuq_fb4[16] = GGML_KVQ_NUQ_FALLBACK_4;
static const int8_t nuq_fb3[16] = GGML_KVQ_NUQ_FALLBACK_3;   // padded with zeros to 16
static const int8_t nuq_fb2[16] = GGML_KVQ_NUQ_FALLBACK_2;

NUQ_INLINE int nuq_n_codes(const enum ggml_type t) {
    return t == GGML_TYPE_NUQ4 ? 16 : (t == GGML_TYPE_NUQ3 || t == GGML_TYPE_NUQ3O || t == GGML_TYPE_NUQ3_64) ? 8 : 4;
}
NUQ_INLINE int nuq_qk(const enum ggml_type t) {
    return ggml_kvq_type_qk(t);
}
NUQ_INLINE bool nuq_outl(const enum ggml_type t) {
    return ggml_kvq_type_outl(t);
}
// the 2-bit fields (qs) and third bits (qh) of a block of 64 (nuq3o, nuq2o, nuq3_64, nuq2_64): the same layout,
// after the outlier's fields where there is one
NUQ_INLINE size_t nuq_qs64(const enum ggml_type t) {
    return nuq_outl(t) ? offsetof(block_nuq3o, qs) : offsetof(block_nuq3_64, qs);
}
NUQ_INLINE size_t nuq_qh64(const enum ggml_type t) {
    return nuq_outl(t) ? offsetof(block_nuq3o, qh) : offsetof(block_nuq3_64, qh);
}
NUQ_INLINE size_t nuq_bs(const enum ggml_type t) {
    switch (t) {
        case GGML_TYPE_NUQ4:  return sizeof(block_nuq4);
        case GGML_TYPE_NUQ3:  return sizeof(block_nuq3);
        case GGML_TYPE_NUQ2:  return sizeof(block_nuq2);
        case GGML_TYPE_NUQ3O: return sizeof(block_nuq3o);
        case GGML_TYPE_NUQ3_64: return sizeof(block_nuq3_64);
        case GGML_TYPE_NUQ2_64: return sizeof(block_nuq2_64);
        default:              return sizeof(block_nuq2o);
    }
}
NUQ_INLINE const int8_t * nuq_fallback16(const enum ggml_type t) {
    const int nc = nuq_n_codes(t);
    return nc == 16 ? nuq_fb4 : nc == 8 ? nuq_fb3 : nuq_fb2;
}
// 16 entries (zeros past n_codes)
NUQ_INLINE const int8_t * nuq_cb_a(const enum ggml_type t) {
    return (nuq_tl.bits & 1u) ? nuq_tl.a : nuq_fallback16(t);
}
NUQ_INLINE const int8_t * nuq_cb_b(const enum ggml_type t) {
    return (nuq_tl.bits & 2u) ? nuq_tl.b : nuq_fallback16(t);
}

void ggml_kvq_cpu_bind_codebooks(const int8_t * cb_a, const int8_t * cb_b) {
    unsigned bits = 0;
    memset(nuq_tl.a, 0, sizeof(nuq_tl.a));
    memset(nuq_tl.b, 0, sizeof(nuq_tl.b));
    if (cb_a) { memcpy(nuq_tl.a, cb_a, GGML_KVQ_NUQ_MAX_CODES); bits |= 1u; }
    if (cb_b) { memcpy(nuq_tl.b, cb_b, GGML_KVQ_NUQ_MAX_CODES); bits |= 2u; }
    nuq_tl.bits = bits | ((cb_a || cb_b) ? 4u : 0u);
    ggml_kvq_bind_codebooks(cb_a, cb_b);
}

static inline bool nuq_node_involved(const struct ggml_tensor * node) {
    if (ggml_kvq_type_is_nuq(node->type)) {
        return true;
    }
    for (int i = 0; i < 3; ++i) {
        if (node->src[i] && ggml_kvq_type_is_nuq(node->src[i]->type)) {
            return true;
        }
    }
    return false;
}

void ggml_kvq_cpu_bind(const struct ggml_tensor * node) {
    if (node == NULL || !nuq_node_involved(node)) {
        if (nuq_tl.bits) {          // leave nothing behind for the next node / caller
            nuq_tl.bits = 0;
            ggml_kvq_bind_codebooks(NULL, NULL);
        }
        return;
    }
    int8_t a[GGML_KVQ_NUQ_MAX_CODES], b[GGML_KVQ_NUQ_MAX_CODES];
    const unsigned bits = ggml_kvq_get_codebooks(node, a, b);
    memcpy(nuq_tl.a, a, sizeof(a));
    memcpy(nuq_tl.b, b, sizeof(b));
    nuq_tl.bits = bits | 4u;
    ggml_kvq_bind_codebooks((bits & 1u) ? a : NULL, (bits & 2u) ? b : NULL);
}

//
// shared scalar pieces
//

// the dense part of a block: for outlier types x with its largest value zeroed (in tmp), the
// outlier's position and value in oi / ov; other types pass x through (oi = 0, ov = 0)
static inline const float * nuq_dense(const enum ggml_type t, const float * x, int qk, float * tmp, int * oi, float * ov) {
    *oi = 0;
    *ov = 0.0f;
    if (!nuq_outl(t)) {
        return x;
    }
    *oi = ggml_kvq_nuq_outlier(x, qk);
    *ov = x[*oi];
    memcpy(tmp, x, sizeof(float) * qk);
    tmp[*oi] = 0.0f;
    return tmp;
}

static inline void nuq_mids(const int8_t * cb, int n_codes, float * mid) {
    for (int j = 0; j + 1 < n_codes; ++j) {
        mid[j] = ((float) cb[j] + (float) cb[j + 1]) * 0.5f;
    }
}

// one row through a SIMD variant's block indexer (nuq_index_block_<isa>: the block's scale and each value's index):
// the dense part of each block (its outlier, if any, set aside), then the format's packer
typedef float (*nuq_index_block_t)(const float * x, int qk, const float * mid, int nm, uint8_t * idx);
NUQ_INLINE void nuq_quantize_simd(const enum ggml_type t, const float * x, void * vy, int64_t k, nuq_index_block_t index_block) {
    const int nm = nuq_n_codes(t) - 1;
    float mid[GGML_KVQ_NUQ_MAX_CODES - 1];
    nuq_mids(nuq_cb_a(t), nm + 1, mid);
    const int    qk = nuq_qk(t);
    const size_t bs = nuq_bs(t);
    uint8_t idx[QK_NUQO];
    float   tmp[QK_NUQO];
    for (int64_t i = 0; i < k / qk; ++i, x += qk) {
        int   oi;
        float ov;
        const float * xb = nuq_dense(t, x, qk, tmp, &oi, &ov);
        const float d = index_block(xb, qk, mid, nm, idx);
        ggml_kvq_nuq_pack(t, idx, d, ov, oi, (char *) vy + i*bs);
    }
}

// index of value j of a block (scalar; the outlier correction needs one)
NUQ_INLINE int nuq_idx_at(const enum ggml_type t, const uint8_t * b, int j) {
    switch (t) {
        case GGML_TYPE_NUQ4: {
            const block_nuq4 * x = (const block_nuq4 *) b;
            return j < 16 ? (x->qs[j] & 15) : (x->qs[j - 16] >> 4);
        }
        case GGML_TYPE_NUQ3: {
            const block_nuq3 * x = (const block_nuq3 *) b;
            return ((x->qs[j % 8] >> (2*(j / 8))) & 3) | (((x->qh[j / 8] >> (j % 8)) & 1) << 2);
        }
        case GGML_TYPE_NUQ2: {
            const block_nuq2 * x = (const block_nuq2 *) b;
            return (x->qs[j % 8] >> (2*(j / 8))) & 3;
        }
        default: {   // blocks of 64
            const uint8_t * qs = b + nuq_qs64(t);
            const int lo = (qs[j % 16] >> (2*(j / 16))) & 3;
            return nuq_n_codes(t) == 8 ? lo | (((b[nuq_qh64(t) + j / 8] >> (j % 8)) & 1) << 2) : lo;
        }
    }
}

// (ov - d·c[idx[oi]])·q8[oi]·d8 for one block-64 (y: its two q8_0 blocks)
NUQ_INLINE float nuq_outlier_corr(const enum ggml_type t, const uint8_t * b, float d, const int8_t * cb, const nuq_q8_0 * y) {
    const int oi = b[offsetof(block_nuq3o, oi)];   // same offset in block_nuq2o
    if (oi >= QK_NUQO) {
        return 0.0f;
    }
    const float ov = NUQ_D(b + offsetof(block_nuq3o, ov));
    const float c  = (float) cb[nuq_idx_at(t, b, oi)];
    return (ov - d * c) * (float) y[oi / 32].qs[oi % 32] * NUQ_H2F(y[oi / 32].d);
}

//
// generic (scalar)
//

#if defined(__GNUC__) && !defined(__clang__)
#define NUQ_SCALAR __attribute__((optimize("no-tree-loop-vectorize")))
#else
#define NUQ_SCALAR
#endif

NUQ_INLINE void nuq_quantize_generic(const enum ggml_type t, const float * x, void * y, int64_t k) {
    const int8_t * cb = nuq_cb_a(t);
    switch (t) {
        case GGML_TYPE_NUQ4:  quantize_row_nuq4_ref_cb (x, y, k, cb); break;
        case GGML_TYPE_NUQ3:  quantize_row_nuq3_ref_cb (x, y, k, cb); break;
        case GGML_TYPE_NUQ2:  quantize_row_nuq2_ref_cb (x, y, k, cb); break;
        case GGML_TYPE_NUQ3O: quantize_row_nuq3o_ref_cb(x, y, k, cb); break;
        case GGML_TYPE_NUQ3_64: quantize_row_nuq3_64_ref_cb(x, y, k, cb); break;
        case GGML_TYPE_NUQ2_64: quantize_row_nuq2_64_ref_cb(x, y, k, cb); break;
        default:              quantize_row_nuq2o_ref_cb(x, y, k, cb); break;
    }
}

NUQ_INLINE void nuq_to_float_generic(const enum ggml_type t, const int8_t * cb, const void * x, float * y, int64_t k) {
    switch (t) {
        case GGML_TYPE_NUQ4:  dequantize_row_nuq4_cb (x, y, k, cb); break;
        case GGML_TYPE_NUQ3:  dequantize_row_nuq3_cb (x, y, k, cb); break;
        case GGML_TYPE_NUQ2:  dequantize_row_nuq2_cb (x, y, k, cb); break;
        case GGML_TYPE_NUQ3O: dequantize_row_nuq3o_cb(x, y, k, cb); break;
        case GGML_TYPE_NUQ3_64: dequantize_row_nuq3_64_cb(x, y, k, cb); break;
        case GGML_TYPE_NUQ2_64: dequantize_row_nuq2_64_cb(x, y, k, cb); break;
        default:              dequantize_row_nuq2o_cb(x, y, k, cb); break;
    }
}

NUQ_INLINE void nuq_vec_dot_generic(const enum ggml_type t, int n, float * s, const void * vx, const void * vy) {
    const int8_t *   cb = nuq_cb_a(t);
    const nuq_q8_0 * y  = vy;
    const int        qk = nuq_qk(t);
    const size_t     bs = nuq_bs(t);
    float sumf = 0.0f;
    for (int i = 0; i < n / qk; ++i) {
        const uint8_t * b = (const uint8_t *) vx + i*bs;
        const float     d = NUQ_D(b);
        for (int h = 0; h < qk / 32; ++h) {
            const nuq_q8_0 * yy = y + i*(qk/32) + h;
            int sumi = 0;
            for (int j = 0; j < 32; ++j) {
                sumi += cb[nuq_idx_at(t, b, 32*h + j)] * yy->qs[j];
            }
            sumf += (d * NUQ_H2F(yy->d)) * (float) sumi;
        }
        if (nuq_outl(t)) {
            sumf += nuq_outlier_corr(t, b, d, cb, y + 2*i);
        }
    }
    *s = sumf;
}

//
// x86: 32 indices of one 32-value group as bytes, codebook values by pshufb
//

#if defined(__AVX2__)
// byte i = 0xFF where bit i of x is set (upstream's bytes_from_bits_32)
static inline __m256i nuq_bits32_avx2(uint32_t x) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int) x), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}

// indices of values 32h .. 32h+31 of the block at b
NUQ_INLINE __m256i nuq_idx32_avx2(const enum ggml_type t, const uint8_t * b, const int h) {
    const __m256i m3 = _mm256_set1_epi8(3);
    switch (t) {
        case GGML_TYPE_NUQ4: {
            const __m128i q  = _mm_loadu_si128((const __m128i *) (b + offsetof(block_nuq4, qs)));
            const __m128i m4 = _mm_set1_epi8(0x0F);
            return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
        }
        case GGML_TYPE_NUQ3:
        case GGML_TYPE_NUQ2: {
            int64_t q; memcpy(&q, b + offsetof(block_nuq3, qs), 8);   // same offset in block_nuq2
            __m256i idx = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(q), _mm256_set_epi64x(6, 4, 2, 0)), m3);
            if (t == GGML_TYPE_NUQ3) {
                uint32_t qh; memcpy(&qh, b + offsetof(block_nuq3, qh), 4);
                idx = _mm256_or_si256(idx, _mm256_and_si256(nuq_bits32_avx2(qh), _mm256_set1_epi8(4)));
            }
            return idx;
        }
        default: {   // blocks of 64 (NUQ3O, NUQ2O, NUQ3_64, NUQ2_64): qs byte j holds values j + 16k at bits 2k
            const __m256i q  = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) (b + nuq_qs64(t))));
            const __m256i sh = h == 0 ? _mm256_set_epi64x(2, 2, 0, 0) : _mm256_set_epi64x(6, 6, 4, 4);
            __m256i idx = _mm256_and_si256(_mm256_srlv_epi64(q, sh), m3);
            if (nuq_n_codes(t) == 8) {
                uint32_t qh; memcpy(&qh, b + nuq_qh64(t) + 4*h, 4);
                idx = _mm256_or_si256(idx, _mm256_and_si256(nuq_bits32_avx2(qh), _mm256_set1_epi8(4)));
            }
            return idx;
        }
    }
}

// 32 int8 · 32 int8 -> 8 int32 partial sums as floats (|codebook| <= 127 keeps maddubs exact)


NUQ_INLINE void nuq_vec_dot_avx2(const enum ggml_type t, int n, float * s, const void * vx, const void * vy) {
    const int8_t *   cb  = nuq_cb_a(t);
    const __m256i    cbv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) cb));
    const nuq_q8_0 * y   = vy;
    const int        qk  = nuq_qk(t);
    const size_t     bs  = nuq_bs(t);
    __m256 acc  = _mm256_setzero_ps();
    float  corr = 0.0f;
    for (int i = 0; i < n / qk; ++i) {
        const uint8_t * b = (const uint8_t *) vx + i*bs;
        const float     d = NUQ_D(b);
        for (int h = 0; h < qk / 32; ++h) {
            const nuq_q8_0 * yy = y + i*(qk/32) + h;
            const __m256i    kv = _mm256_shuffle_epi8(cbv, nuq_idx32_avx2(t, b, h));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * NUQ_H2F(yy->d)),
                                  kvq_dot32_avx2(kv, _mm256_loadu_si256((const __m256i *) yy->qs)), acc);
        }
        if (nuq_outl(t)) {
            corr += nuq_outlier_corr(t, b, d, cb, y + 2*i);
        }
    }
    *s = kvq_hsum_avx2(acc) + corr;
}

// 32 int8 codebook values times d -> 32 floats

typedef void (*nuq_store32_x86_t)(float * y, __m256i q, float d);

// dequantizer loop shared by AVX2 and AVX-512; only the 32-value store differs
NUQ_INLINE void nuq_to_float_x86(const enum ggml_type t, const int8_t * cb, const void * vx, float * y, int64_t k, nuq_store32_x86_t store) {
    const __m256i  cbv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) cb));
    const int      qk  = nuq_qk(t);
    const size_t   bs  = nuq_bs(t);
    for (int64_t i = 0; i < k / qk; ++i, y += qk) {
        const uint8_t * b = (const uint8_t *) vx + i*bs;
        const float     d = NUQ_D(b);
        for (int h = 0; h < qk / 32; ++h) {
            store(y + 32*h, _mm256_shuffle_epi8(cbv, nuq_idx32_avx2(t, b, h)), d);
        }
        if (nuq_outl(t)) {
            const int oi = b[offsetof(block_nuq3o, oi)];
            if (oi < QK_NUQO) {
                y[oi] = NUQ_D(b + offsetof(block_nuq3o, ov));
            }
        }
    }
}

// quantize: amax, v = x·id and the midpoint count on 8 floats at a time
static inline float nuq_hmax_avx2(__m256 v) {
    __m128 r = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    r = _mm_max_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

// the dense part of one block of qk (32 or 64) values -> idx[], returns d
static inline float nuq_index_block_avx2(const float * x, int qk, const float * mid, int nm, uint8_t * idx) {
    __m256 vm[GGML_KVQ_NUQ_MAX_CODES - 1];
    for (int m = 0; m < nm; ++m) {
        vm[m] = _mm256_set1_ps(mid[m]);
    }
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < qk; j += 8) {
        // maxps returns its second operand when either is NaN: a NaN |x| leaves acc as it is
        acc = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), acc);
    }
    const float amax = nuq_hmax_avx2(acc);
    const float d    = ggml_kvq_nuq_clamp_d(amax / 127.0f);
    const float id   = ggml_kvq_nuq_use_id(d) ? 1.0f / d : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    for (int j = 0; j < qk; j += 32) {
        __m256i c[4];
        for (int u = 0; u < 4; ++u) {
            const __m256 xv = _mm256_loadu_ps(x + j + 8*u);
            // NaN is read as 0 (the ordered compare is all-zero bits there)
            const __m256 v  = _mm256_mul_ps(_mm256_and_ps(xv, _mm256_cmp_ps(xv, xv, _CMP_ORD_Q)), vid);
            __m256i cnt = _mm256_setzero_si256();
            for (int m = 0; m < nm; ++m) {
                cnt = _mm256_sub_epi32(cnt, _mm256_castps_si256(_mm256_cmp_ps(v, vm[m], _CMP_GT_OQ)));
            }
            c[u] = cnt;
        }
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        const __m256i o = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *) (idx + j), o);
    }
    return d;
}

#endif // __AVX2__

//
// AVX-512 (BW + VL, VNNI when present): two 32-value groups per 512-bit register
//

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX2__)
#define NUQ_HAVE_AVX512 1



// 32-value group g of the row: block g / (qk/32), half g % (qk/32)
NUQ_INLINE __m256i nuq_group_kv_avx512(const enum ggml_type t, const uint8_t * x, int g, __m256i cbv, float * d) {
    const int       per = nuq_qk(t) / 32;
    const uint8_t * b   = x + (size_t) (g / per) * nuq_bs(t);
    *d = NUQ_D(b);
    return _mm256_shuffle_epi8(cbv, nuq_idx32_avx2(t, b, g % per));
}

NUQ_INLINE void nuq_vec_dot_avx512(const enum ggml_type t, int n, float * s, const void * vx, const void * vy) {
    const int8_t *   cb  = nuq_cb_a(t);
    const __m256i    cbv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) cb));
    const nuq_q8_0 * y   = vy;
    const uint8_t *  x   = vx;
    const int        ng  = n / 32;
    __m512 acc = _mm512_setzero_ps();
    int g = 0;
    for (; g + 1 < ng; g += 2) {
        float d0, d1;
        const __m256i k0 = nuq_group_kv_avx512(t, x, g,     cbv, &d0);
        const __m256i k1 = nuq_group_kv_avx512(t, x, g + 1, cbv, &d1);
        const __m512i qy = kvq_join256(_mm256_loadu_si256((const __m256i *) y[g].qs),
                                       _mm256_loadu_si256((const __m256i *) y[g + 1].qs));
        const __m512  sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0 * NUQ_H2F(y[g].d)),
                                                        _mm512_set1_ps(d1 * NUQ_H2F(y[g + 1].d)));
        acc = _mm512_fmadd_ps(sc, kvq_dot64_avx512(kvq_join256(k0, k1), qy), acc);
    }
    float sumf = _mm512_reduce_add_ps(acc);
    if (g < ng) {   // odd number of 32-blocks (32-value types only)
        float d0;
        const __m256i k0 = nuq_group_kv_avx512(t, x, g, cbv, &d0);
        sumf += (d0 * NUQ_H2F(y[g].d)) * kvq_hsum_avx2(kvq_dot32_avx2(k0, _mm256_loadu_si256((const __m256i *) y[g].qs)));
    }
    if (nuq_outl(t)) {
        for (int i = 0; i < n / QK_NUQO; ++i) {
            const uint8_t * b = x + (size_t) i * nuq_bs(t);
            sumf += nuq_outlier_corr(t, b, NUQ_D(b), cb, y + 2*i);
        }
    }
    *s = sumf;
}


static inline float nuq_index_block_avx512(const float * x, int qk, const float * mid, int nm, uint8_t * idx) {
    __m512 vm[GGML_KVQ_NUQ_MAX_CODES - 1];
    for (int m = 0; m < nm; ++m) {
        vm[m] = _mm512_set1_ps(mid[m]);
    }
    __m512 acc = _mm512_setzero_ps();
    for (int j = 0; j < qk; j += 16) {
        acc = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j)), acc);   // NaN leaves acc
    }
    const float amax = _mm512_reduce_max_ps(acc);
    const float d    = ggml_kvq_nuq_clamp_d(amax / 127.0f);
    const float id   = ggml_kvq_nuq_use_id(d) ? 1.0f / d : 0.0f;
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i one = _mm512_set1_epi32(1);
    for (int j = 0; j < qk; j += 16) {
        const __m512 xv = _mm512_loadu_ps(x + j);
        const __m512 v  = _mm512_mul_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(xv, xv, _CMP_ORD_Q), xv), vid);   // NaN -> 0
        __m512i cnt = _mm512_setzero_si512();
        for (int m = 0; m < nm; ++m) {
            cnt = _mm512_mask_add_epi32(cnt, _mm512_cmp_ps_mask(v, vm[m], _CMP_GT_OQ), cnt, one);
        }
        _mm_storeu_si128((__m128i *) (idx + j), _mm512_cvtepi32_epi8(cnt));
    }
    return d;
}

#endif // AVX-512

//
// NEON (sdot when the target has it): tbl lookup of the codebook
//

#if defined(__ARM_NEON) && defined(__aarch64__)

// 0x04 in byte i where bit i of the 16 bits (b0 | b1 << 8) is set
static inline uint8x16_t nuq_bits16_neon(uint8_t b0, uint8_t b1) {
    static const uint8_t bit[16] = { 1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128 };
    const uint8x16_t v = vcombine_u8(vdup_n_u8(b0), vdup_n_u8(b1));
    return vandq_u8(vtstq_u8(v, vld1q_u8(bit)), vdupq_n_u8(4));
}

// indices of values 32h .. 32h+15 (lo) and 32h+16 .. 32h+31 (hi) of the block at b
NUQ_INLINE void nuq_idx32_neon(const enum ggml_type t, const uint8_t * b, const int h, uint8x16_t * lo, uint8x16_t * hi) {
    const uint8x16_t m3 = vdupq_n_u8(3);
    switch (t) {
        case GGML_TYPE_NUQ4: {
            const uint8x16_t q = vld1q_u8(b + offsetof(block_nuq4, qs));
            *lo = vandq_u8(q, vdupq_n_u8(0x0F));
            *hi = vshrq_n_u8(q, 4);
        } break;
        case GGML_TYPE_NUQ3:
        case GGML_TYPE_NUQ2: {
            const uint8x8_t  q  = vld1_u8(b + offsetof(block_nuq3, qs));
            const uint8x16_t q2 = vcombine_u8(q, q);
            *lo = vandq_u8(vshlq_u8(q2, vcombine_s8(vdup_n_s8(0),  vdup_n_s8(-2))), m3);
            *hi = vandq_u8(vshlq_u8(q2, vcombine_s8(vdup_n_s8(-4), vdup_n_s8(-6))), m3);
            if (t == GGML_TYPE_NUQ3) {
                const uint8_t * qh = b + offsetof(block_nuq3, qh);
                *lo = vorrq_u8(*lo, nuq_bits16_neon(qh[0], qh[1]));
                *hi = vorrq_u8(*hi, nuq_bits16_neon(qh[2], qh[3]));
            }
        } break;
        default: {   // blocks of 64 (NUQ3O, NUQ2O, NUQ3_64, NUQ2_64): qs byte j holds values j + 16k at bits 2k
            const uint8x16_t q = vld1q_u8(b + nuq_qs64(t));
            if (h == 0) {
                *lo = vandq_u8(q, m3);
                *hi = vandq_u8(vshrq_n_u8(q, 2), m3);
            } else {
                *lo = vandq_u8(vshrq_n_u8(q, 4), m3);
                *hi = vshrq_n_u8(q, 6);
            }
            if (nuq_n_codes(t) == 8) {
                const uint8_t * qh = b + nuq_qh64(t) + 4*h;
                *lo = vorrq_u8(*lo, nuq_bits16_neon(qh[0], qh[1]));
                *hi = vorrq_u8(*hi, nuq_bits16_neon(qh[2], qh[3]));
            }
        } break;
    }
}

NUQ_INLINE void nuq_vec_dot_neon(const enum ggml_type t, int n, float * s, const void * vx, const void * vy) {
    const int8_t *   cb  = nuq_cb_a(t);
    const int8x16_t  cbv = vld1q_s8(cb);
    const nuq_q8_0 * y   = vy;
    const int        qk  = nuq_qk(t);
    const size_t     bs  = nuq_bs(t);
    float32x4_t acc  = vdupq_n_f32(0.0f);
    float       corr = 0.0f;
    for (int i = 0; i < n / qk; ++i) {
        const uint8_t * b = (const uint8_t *) vx + i*bs;
        const float     d = NUQ_D(b);
        for (int h = 0; h < qk / 32; ++h) {
            const nuq_q8_0 * yy = y + i*(qk/32) + h;
            uint8x16_t lo, hi;
            nuq_idx32_neon(t, b, h, &lo, &hi);
            int32x4_t p = kvq_dot16_neon(vdupq_n_s32(0), vqtbl1q_s8(cbv, lo), vld1q_s8(yy->qs));
            p = kvq_dot16_neon(p, vqtbl1q_s8(cbv, hi), vld1q_s8(yy->qs + 16));
            acc = vmlaq_n_f32(acc, vcvtq_f32_s32(p), d * NUQ_H2F(yy->d));
        }
        if (nuq_outl(t)) {
            corr += nuq_outlier_corr(t, b, d, cb, y + 2*i);
        }
    }
    *s = vaddvq_f32(acc) + corr;
}


NUQ_INLINE void nuq_to_float_neon(const enum ggml_type t, const int8_t * cb, const void * vx, float * y, int64_t k) {
    const int8x16_t cbv = vld1q_s8(cb);
    const int       qk  = nuq_qk(t);
    const size_t    bs  = nuq_bs(t);
    for (int64_t i = 0; i < k / qk; ++i, y += qk) {
        const uint8_t * b = (const uint8_t *) vx + i*bs;
        const float     d = NUQ_D(b);
        for (int h = 0; h < qk / 32; ++h) {
            uint8x16_t lo, hi;
            nuq_idx32_neon(t, b, h, &lo, &hi);
            kvq_store16_neon(y + 32*h,      vqtbl1q_s8(cbv, lo), d);
            kvq_store16_neon(y + 32*h + 16, vqtbl1q_s8(cbv, hi), d);
        }
        if (nuq_outl(t)) {
            const int oi = b[offsetof(block_nuq3o, oi)];
            if (oi < QK_NUQO) {
                y[oi] = NUQ_D(b + offsetof(block_nuq3o, ov));
            }
        }
    }
}

static inline float nuq_index_block_neon(const float * x, int qk, const float * mid, int nm, uint8_t * idx) {
    float32x4_t vm[GGML_KVQ_NUQ_MAX_CODES - 1];
    for (int m = 0; m < nm; ++m) {
        vm[m] = vdupq_n_f32(mid[m]);
    }
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int j = 0; j < qk; j += 4) {
        const float32x4_t v = vld1q_f32(x + j);
        // NaN (quiet or signalling) counts as 0: mask it out before the max
        const float32x4_t a = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(vabsq_f32(v)), vceqq_f32(v, v)));
        acc = vmaxq_f32(acc, a);
    }
    const float amax = vmaxvq_f32(acc);
    const float d    = ggml_kvq_nuq_clamp_d(amax / 127.0f);
    const float id   = ggml_kvq_nuq_use_id(d) ? 1.0f / d : 0.0f;
    for (int j = 0; j < qk; j += 16) {
        uint16x4_t c16[4];
        for (int u = 0; u < 4; ++u) {
            const float32x4_t xv = vld1q_f32(x + j + 4*u);
            // NaN is read as 0
            const float32x4_t x0 = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(xv), vceqq_f32(xv, xv)));
            const float32x4_t v  = vmulq_n_f32(x0, id);
            uint32x4_t cnt = vdupq_n_u32(0);
            for (int m = 0; m < nm; ++m) {
                cnt = vsubq_u32(cnt, vcgtq_f32(v, vm[m]));
            }
            c16[u] = vmovn_u32(cnt);
        }
        const uint8x8_t b0 = vmovn_u16(vcombine_u16(c16[0], c16[1]));
        const uint8x8_t b1 = vmovn_u16(vcombine_u16(c16[2], c16[3]));
        vst1q_u8(idx + j, vcombine_u8(b0, b1));
    }
    return d;
}

#endif // NEON

//
// per-type instances and the variant table: generic first, the best compiled variant last
//

// every nuq type once: the instances, the table's slots (in this order) and the public entry points are made from it;
// X(name, type, ...) gets the caller's extra argument (NUQ_TYPES(X, arg)) after the two
#define NUQ_TYPES(X, ...) X(nuq4, GGML_TYPE_NUQ4, __VA_ARGS__) X(nuq3, GGML_TYPE_NUQ3, __VA_ARGS__) \
                          X(nuq2, GGML_TYPE_NUQ2, __VA_ARGS__) X(nuq3o, GGML_TYPE_NUQ3O, __VA_ARGS__) \
                          X(nuq2o, GGML_TYPE_NUQ2O, __VA_ARGS__) X(nuq3_64, GGML_TYPE_NUQ3_64, __VA_ARGS__) \
                          X(nuq2_64, GGML_TYPE_NUQ2_64, __VA_ARGS__)
#define NUQ_COUNT(name, T, ...) + 1
enum { NUQ_N_TYPES = 0 NUQ_TYPES(NUQ_COUNT, 0) };

#define NUQ_INST_GENERIC(name, T, ...)                                                                              \
    static void quantize_##name##_generic(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {   \
        nuq_quantize_generic(T, x, y, k); }                                                                    \
    NUQ_SCALAR static void vec_dot_##name##_generic(NUQ_VEC_DOT_ARGS) { NUQ_UNUSED_ARGS; nuq_vec_dot_generic(T, n, s, vx, vy); } \
    static void to_float_##name##_generic(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {  \
        nuq_to_float_generic(T, nuq_cb_b(T), x, y, k); } \
    static void to_float_k_##name##_generic(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {  \
        nuq_to_float_generic(T, nuq_cb_a(T), x, y, k); }
NUQ_TYPES(NUQ_INST_GENERIC, 0)

// the x86 instances of one ISA (avx2, avx512): the same code over that ISA's block indexer, K·Q and store
#define NUQ_INST_X86(name, T, isa)                                                                             \
    static void quantize_##name##_##isa(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {     \
        nuq_quantize_simd(T, x, y, k, nuq_index_block_##isa); }                                                \
    static void vec_dot_##name##_##isa(NUQ_VEC_DOT_ARGS) { NUQ_UNUSED_ARGS; nuq_vec_dot_##isa(T, n, s, vx, vy); } \
    static void to_float_##name##_##isa(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {    \
        nuq_to_float_x86(T, nuq_cb_b(T), x, y, k, kvq_store32_##isa); }                                        \
    static void to_float_k_##name##_##isa(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {  \
        nuq_to_float_x86(T, nuq_cb_a(T), x, y, k, kvq_store32_##isa); }
#if defined(__AVX2__)
NUQ_TYPES(NUQ_INST_X86, avx2)
#endif
#if defined(NUQ_HAVE_AVX512)
NUQ_TYPES(NUQ_INST_X86, avx512)
#endif

#if defined(__ARM_NEON) && defined(__aarch64__)
#define NUQ_INST_NEON(name, T, ...)                                                                                 \
    static void quantize_##name##_neon(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {      \
        nuq_quantize_simd(T, x, y, k, nuq_index_block_neon); }                                                                       \
    static void vec_dot_##name##_neon(NUQ_VEC_DOT_ARGS) { NUQ_UNUSED_ARGS; nuq_vec_dot_neon(T, n, s, vx, vy); } \
    static void to_float_##name##_neon(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {     \
        nuq_to_float_neon(T, nuq_cb_b(T), x, y, k); } \
    static void to_float_k_##name##_neon(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) {  \
        nuq_to_float_neon(T, nuq_cb_a(T), x, y, k); }
NUQ_TYPES(NUQ_INST_NEON, 0)
#endif

struct nuq_impl {
    const char *      name;
    ggml_from_float_t from_float[NUQ_N_TYPES];   // per type, in NUQ_TYPES' order
    ggml_vec_dot_t    vec_dot[NUQ_N_TYPES];
    ggml_to_float_t   to_float[NUQ_N_TYPES];     // slot-B codebook (V)
    ggml_to_float_t   to_float_k[NUQ_N_TYPES];   // slot-A codebook (K tiles in flash attention)
};

#define NUQ_FROM_FLOAT(name, T, sfx) quantize_##name##_##sfx,
#define NUQ_VEC_DOT(name, T, sfx)    vec_dot_##name##_##sfx,
#define NUQ_TO_FLOAT(name, T, sfx)   to_float_##name##_##sfx,
#define NUQ_TO_FLOAT_K(name, T, sfx) to_float_k_##name##_##sfx,
#define NUQ_IMPL(name, sfx) { name, { NUQ_TYPES(NUQ_FROM_FLOAT, sfx) }, { NUQ_TYPES(NUQ_VEC_DOT, sfx) }, \
                                    { NUQ_TYPES(NUQ_TO_FLOAT, sfx) },   { NUQ_TYPES(NUQ_TO_FLOAT_K, sfx) } }

// the same variants, in the same order, as cpu/bfp-cpu.c's table (ggml_kvq_cpu_impl_* index both)
static const struct nuq_impl nuq_impls[] = {
    NUQ_IMPL("generic", generic),
#if defined(__AVX2__)
    NUQ_IMPL("avx2", avx2),
#endif
#if defined(NUQ_HAVE_AVX512)
#if defined(__AVX512VNNI__)
    NUQ_IMPL("avx512vnni", avx512),
#else
    NUQ_IMPL("avx512", avx512),
#endif
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
#if defined(__ARM_FEATURE_DOTPROD)
    NUQ_IMPL("neon-dotprod", neon),
#else
    NUQ_IMPL("neon", neon),
#endif
#endif
};

#define NUQ_N_IMPLS ((int) (sizeof(nuq_impls) / sizeof(nuq_impls[0])))
#define NUQ_BEST (&nuq_impls[NUQ_N_IMPLS - 1])

// a type's slot in the table (-1: not a nuq type)
static inline int nuq_slot(enum ggml_type type) {
    int i = 0;
#define NUQ_SLOT(name, T, ...) if (type == (T)) { return i; } ++i;
    NUQ_TYPES(NUQ_SLOT, 0)
#undef NUQ_SLOT
    return -1;
}

#define NUQ_ENTRY_POINTS(name, T, ...)                                                                                 \
    void quantize_row_##name(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {                      \
        NUQ_BEST->from_float[nuq_slot(T)](x, y, k); }                                                                  \
    void ggml_vec_dot_##name##_q8_0(NUQ_VEC_DOT_ARGS) { NUQ_BEST->vec_dot[nuq_slot(T)](n, s, bs, vx, bx, vy, by, nrc); }
NUQ_TYPES(NUQ_ENTRY_POINTS, 0)

int ggml_kvq_nuq_cpu_n_impls(void) {
    return NUQ_N_IMPLS;
}

const char * ggml_kvq_nuq_cpu_impl_name(int i) {
    return i >= 0 && i < NUQ_N_IMPLS ? nuq_impls[i].name : NULL;
}

ggml_from_float_t ggml_kvq_nuq_cpu_impl_from_float(int i, enum ggml_type type) {
    const int slot = nuq_slot(type);
    return i >= 0 && i < NUQ_N_IMPLS && slot >= 0 ? nuq_impls[i].from_float[slot] : NULL;
}

ggml_vec_dot_t ggml_kvq_nuq_cpu_impl_vec_dot(int i, enum ggml_type type) {
    const int slot = nuq_slot(type);
    return i >= 0 && i < NUQ_N_IMPLS && slot >= 0 ? nuq_impls[i].vec_dot[slot] : NULL;
}

ggml_to_float_t ggml_kvq_nuq_cpu_impl_to_float(int i, enum ggml_type type) {
    const int slot = nuq_slot(type);
    return i >= 0 && i < NUQ_N_IMPLS && slot >= 0 ? nuq_impls[i].to_float[slot] : NULL;
}

ggml_to_float_t ggml_kvq_nuq_cpu_impl_to_float_k(int i, enum ggml_type type) {
    const int slot = nuq_slot(type);
    return i >= 0 && i < NUQ_N_IMPLS && slot >= 0 ? nuq_impls[i].to_float_k[slot] : NULL;
}
