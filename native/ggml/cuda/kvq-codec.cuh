// pykvq: block codecs of the cache types for CUDA, written once for device and host.
//
// Every function here is __host__ __device__ and uses integer or correctly rounded float
// operations only, so the host build (native/tests/cuda_codec_check.cpp, run by
// tests/test_cuda.py without a GPU) checks the very code the kernels run against the
// reference quantizers bit for bit. The rules are the ones in ggml-kvq.h / pykvq/ref/.
//
// On the device, ggml-cuda builds with -use_fast_math: divisions go through __fdiv_rn /
// __frcp_rn here so d = amax/127 and 1/d stay correctly rounded; only subnormal inputs
// (|x| < 2^-126) may flush to zero there, which the reference would keep. A block whose d flushes
// is one with d <= 2^-25, where the rule takes id = 0 anyway (ggml_kvq_nuq_use_id): same bytes.
#pragma once

#include "ggml-kvq.h"

#include <stdint.h>

#if defined(__CUDACC__)
#define KVQ_HD __host__ __device__ __forceinline__
#define KVQ_UNROLL _Pragma("unroll")
#include <cuda_fp16.h>
#else
#define KVQ_UNROLL
#define KVQ_HD static inline
#include <math.h>
#endif

// ---- scalar helpers -----------------------------------------------------------------------

// thread i's (element, block or chunk i0 of a row, i1, i2, i3) for rows of n0 of them over ne1 x ne2 x ...
KVQ_HD void kvq_unravel(int64_t i, int64_t n0, int64_t ne1, int64_t ne2,
                        int64_t & i0, int64_t & i1, int64_t & i2, int64_t & i3) {
    i0 = i % n0;  i /= n0;
    i1 = i % ne1; i /= ne1;
    i2 = i % ne2;
    i3 = i / ne2;
}

KVQ_HD uint32_t kvq_f2u(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    union { float f; uint32_t u; } v; v.f = f; return v.u;
#endif
}

KVQ_HD float kvq_u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    union { uint32_t u; float f; } v; v.u = u; return v.f;
#endif
}

KVQ_HD float kvq_div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

KVQ_HD float kvq_mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

KVQ_HD float kvq_add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);     // never fused with a product
#else
    return a + b;
#endif
}

KVQ_HD double kvq_dsub_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dsub_rn(a, b);
#else
    return a - b;
#endif
}

KVQ_HD double kvq_dsq_add_rn(double acc, double r) {   // acc + r*r, rounded twice as the reference rounds it
#if defined(__CUDA_ARCH__)
    return __dadd_rn(acc, __dmul_rn(r, r));
#else
    return acc + r*r;
#endif
}

KVQ_HD float kvq_rint(float x) {          // round half to even (the default mode on the host)
#if defined(__CUDA_ARCH__)
    return rintf(x);
#else
    return nearbyintf(x);
#endif
}

KVQ_HD bool kvq_isnan(float x) { return (kvq_f2u(x) & 0x7FFFFFFFu) > 0x7F800000u; }
KVQ_HD bool kvq_isinf(float x) { return (kvq_f2u(x) & 0x7FFFFFFFu) == 0x7F800000u; }
KVQ_HD float kvq_fabs(float x) { return kvq_u2f(kvq_f2u(x) & 0x7FFFFFFFu); }

KVQ_HD float kvq_f16_bytes(const uint8_t * p) {
#if defined(__CUDA_ARCH__)
    // the hardware conversion: the same value for every f16 (exact), one instruction
    return __half2float(__ushort_as_half((unsigned short) (p[0] | (p[1] << 8))));
#else
    return ggml_kvq_fp16_to_fp32((uint16_t) (p[0] | (p[1] << 8)));
#endif
}

KVQ_HD void kvq_put_f16(uint8_t * p, float f) {
    const uint16_t h = ggml_kvq_fp32_to_fp16(f);   // integer rule: the reference's bits, NaN payloads too
    p[0] = (uint8_t) (h & 0xFF);
    p[1] = (uint8_t) (h >> 8);
}

// ---- type facts ---------------------------------------------------------------------------

template <ggml_type T> struct kvq_traits;
// pykvq's types, one per row of ggml-kvq-types.h
#define KVQ_TRAITS_ROW(name, NAME, id, qk_, family, vdt, VDT, cuda, codes, outl_, bits, ...)         \
    template <> struct kvq_traits<GGML_TYPE_##NAME> {                                                \
        static constexpr int qk = qk_; static constexpr int bs = sizeof(block_##name);              \
        static constexpr int ncodes = codes; static constexpr bool outl = outl_; };
GGML_KVQ_TYPES(KVQ_TRAITS_ROW, 0)
// stock types the decode kernel also reads (K of the mixed pairs)
template <> struct kvq_traits<GGML_TYPE_Q8_0>    { static constexpr int qk = 32; static constexpr int bs = 34; static constexpr int ncodes = 0;  static constexpr bool outl = false; };
template <> struct kvq_traits<GGML_TYPE_F16>     { static constexpr int qk = 1;  static constexpr int bs = 2;  static constexpr int ncodes = 0;  static constexpr bool outl = false; };
// stock q4_0 / q5_0 as pykvq writes them for a tagged SET_ROWS (least-squares scales, kvq_lsq_block)
template <> struct kvq_traits<GGML_TYPE_Q4_0>    { static constexpr int qk = 32; static constexpr int bs = 18; static constexpr int ncodes = 0;  static constexpr bool outl = false; };
template <> struct kvq_traits<GGML_TYPE_Q5_0>    { static constexpr int qk = 32; static constexpr int bs = 22; static constexpr int ncodes = 0;  static constexpr bool outl = false; };


template <ggml_type T> constexpr bool kvq_is_nuq() { return kvq_traits<T>::ncodes > 0; }

// ---- quantize one block (SET_ROWS, CPY) ------------------------------------------------------

// smallest s with rint(amax / 2^s) <= M (M = 2^(bits-1) - 1), biased by 127; frexp by bits
template <int bits>
KVQ_HD uint8_t kvq_bfp_exponent(float amax) {
    if (amax == 0.0f) {
        return 0;
    }
    constexpr int smax = 129 - bits;             // the largest s with M * 2^s finite
    int s;
    if (kvq_isinf(amax)) {
        s = smax;
    } else {
        uint32_t u = kvq_f2u(amax);
        int      E;
        if ((u >> 23) == 0) {                    // subnormal: normalise the mantissa
            int sh = 0;
            uint32_t m = u & 0x7FFFFFu;
            while (!(m & 0x800000u)) { m <<= 1; ++sh; }
            E = -125 - sh;
            u = (m & 0x7FFFFFu) | (126u << 23);
        } else {
            E = (int) (u >> 23) - 126;
            u = (u & 0x807FFFFFu) | (126u << 23);
        }
        const float f = kvq_u2f(u);              // in [0.5, 1)
        const float M = (float) ((1 << (bits - 1)) - 1);
        s = E - (bits - 1) + (f >= (M + 0.5f) / (float) (1 << (bits - 1)));
    }
    s = s < -127 ? -127 : s > smax ? smax : s;
    return (uint8_t) (s + 127);
}

template <int M>
KVQ_HD int kvq_bfp_mantissa(float x, uint8_t e) {
    if (kvq_isnan(x)) {
        return 0;
    }
    if (kvq_isinf(x)) {
        return x > 0 ? M : -M;
    }
    const float inv = kvq_u2f(e == 254 ? 0x00400000u : (uint32_t) (254 - e) << 23);   // 2^(127 - e)
    const float v   = kvq_rint(kvq_mul_rn(x, inv));
    return v > M ? M : v < -M ? -M : (int) v;
}

// nuq: indices of a dense block of n (x[skip] counts as 0); returns d (f32)
template <int n_codes>
KVQ_HD float kvq_nuq_index(const float * x, int n, int skip, const int8_t * cb, uint8_t * idx) {
    float mid[n_codes - 1];
KVQ_UNROLL
    for (int j = 0; j + 1 < n_codes; ++j) {
        mid[j] = ((float) cb[j] + (float) cb[j + 1]) * 0.5f;
    }
    float amax = 0.0f;
    for (int i = 0; i < n; ++i) {
        const float a = i == skip ? 0.0f : kvq_fabs(x[i]);
        if (a > amax) {
            amax = a;
        }
    }
    const float d  = ggml_kvq_nuq_clamp_d(kvq_div_rn(amax, 127.0f));   // never inf as f16
    const float id = ggml_kvq_nuq_use_id(d) ? kvq_div_rn(1.0f, d) : 0.0f;
    for (int i = 0; i < n; ++i) {
        const float v = kvq_mul_rn(i == skip || kvq_isnan(x[i]) ? 0.0f : x[i], id);   // NaN is read as 0
        int k = 0;
KVQ_UNROLL
        for (int j = 0; j + 1 < n_codes; ++j) {
            k += v > mid[j];
        }
        idx[i] = (uint8_t) k;
    }
    return d;
}

KVQ_HD void kvq_pack_low2(const uint8_t * idx, int n, uint8_t * qs) {
    const int q = n / 4;
    for (int j = 0; j < q; ++j) {
        qs[j] = (uint8_t) ((idx[j] & 3) | ((idx[j + q] & 3) << 2) | ((idx[j + 2*q] & 3) << 4) | ((idx[j + 3*q] & 3) << 6));
    }
}

KVQ_HD void kvq_pack_high(const uint8_t * idx, int n, uint8_t * qh) {
    for (int b = 0; b < n / 8; ++b) {
        uint8_t v = 0;
        for (int i = 0; i < 8; ++i) {
            v |= (uint8_t) (((idx[8*b + i] >> 2) & 1) << i);
        }
        qh[b] = v;
    }
}

// least-squares block scales (native/ggml/lsq.c, ggml_kvq_lsq_block): q*_0's levels with half = 2^(bits-1), the scale
// among 26 multiples of the signed-max one whose read-back values have the least squared error (double, summed in
// order, the first of equals). The pieces below serve this serial search and the warp's (kvq_lsq_block_warp).

// a value as the search reads it: NaN as 0, infinities as the largest finite float
KVQ_HD float kvq_lsq_value(float x) {
    constexpr float fmax = 3.40282347e38f;
    return kvq_isnan(x) ? 0.0f : fmaxf(-fmax, fminf(fmax, x));
}

// the block's first value of the largest magnitude, with its sign
KVQ_HD float kvq_lsq_vmax(const float * x) {
    float amax = 0.0f, vmax = 0.0f;
    for (int j = 0; j < GGML_KVQ_LSQ_N; ++j) {
        const float v = kvq_lsq_value(x[j]);
        if (amax < kvq_fabs(v)) {
            amax = kvq_fabs(v);
            vmax = v;
        }
    }
    return vmax;
}

// candidate k's scale (base = vmax / -half), within f16's range, and its inverse (0 for a zero scale)
KVQ_HD float kvq_lsq_d(float base, int k) {
    return fmaxf(-65504.0f, fminf(65504.0f, kvq_mul_rn(base, kvq_div_rn((float) (35 + k), 50.0f))));
}
KVQ_HD float kvq_lsq_inv(float d) {
    return d != 0.0f ? kvq_div_rn(1.0f, d) : 0.0f;
}

// the level in [0, 2*half) of a value (kvq_lsq_value) under the inverse scale id
KVQ_HD int kvq_lsq_level(float v, float id, int half) {
    const float t = kvq_add_rn(kvq_mul_rn(v, id), (float) half + 0.5f);
    const float top = (float) (2*half - 1);
    return (int) (t >= 1.0f ? (t < top ? t : top) : 0.0f);   // NaN: 0
}

// the squared error of the block read back at scale d (stored as f16), in double, summed in order
KVQ_HD double kvq_lsq_error(const float * x, int half, float d) {
    const float id = kvq_lsq_inv(d);
    uint8_t h[2];
    kvq_put_f16(h, d);
    const float dq = kvq_f16_bytes(h);
    double e = 0.0;
    for (int j = 0; j < GGML_KVQ_LSQ_N; ++j) {
        const float  v = kvq_lsq_value(x[j]);
        const double r = kvq_dsub_rn((double) kvq_mul_rn((float) (kvq_lsq_level(v, id, half) - half), dq), (double) v);
        e = kvq_dsq_add_rn(e, r);
    }
    return e;
}

// d_out: the f16 scale's bytes; q[32]: levels in [0, 2*half)
KVQ_HD void kvq_lsq_block(const float * x, int half, uint8_t * d_out, uint8_t * q) {
    const float base = kvq_div_rn(kvq_lsq_vmax(x), (float) -half);
    double best = 0.0;
    int    kb   = 0;
    for (int k = 0; k < GGML_KVQ_LSQ_N_SCALES; ++k) {
        const double e = kvq_lsq_error(x, half, kvq_lsq_d(base, k));
        if (k == 0 || e < best) {
            best = e;
            kb   = k;
        }
    }
    const float d = kvq_lsq_d(base, kb);
    kvq_put_f16(d_out, d);
    const float id = kvq_lsq_inv(d);
    for (int j = 0; j < GGML_KVQ_LSQ_N; ++j) {
        q[j] = (uint8_t) kvq_lsq_level(kvq_lsq_value(x[j]), id, half);
    }
}

// the types whose blocks are least-squares searches (kvq_lsq_block): stock q4_0 / q5_0 as a tagged SET_ROWS writes
// them, and the keys in halves
template <ggml_type T> KVQ_HD constexpr bool kvq_is_lsq() {
    return T == GGML_TYPE_Q4_0 || T == GGML_TYPE_Q5_0 || T == GGML_TYPE_Q53_64 || T == GGML_TYPE_Q42_64 ||
           T == GGML_TYPE_Q32_64;
}
// their searches' level counts: half = 2^(bits-1), of the block's first 32 values and (keys in halves) its last 32
template <ggml_type T> KVQ_HD constexpr int kvq_lsq_half_a() {
    return T == GGML_TYPE_Q32_64 ? 4 : T == GGML_TYPE_Q4_0 || T == GGML_TYPE_Q42_64 ? 8 : 16;
}
template <ggml_type T> KVQ_HD constexpr int kvq_lsq_half_b() { return T == GGML_TYPE_Q53_64 ? 4 : 2; }

// the levels of a least-squares block (qa: its first 32 values, qb: the last 32 of keys in halves) into its bytes;
// the scales are already written (kvq_lsq_block's d_out)
template <ggml_type T>
KVQ_HD void kvq_lsq_pack(const uint8_t * qa, const uint8_t * qb, uint8_t * y) {
    if constexpr (T == GGML_TYPE_Q4_0 || T == GGML_TYPE_Q5_0) {
        const int off = T == GGML_TYPE_Q4_0 ? 2 : 6;       // q5_0: qh[4] (bit j = q(j) >> 4) before qs
        for (int j = 0; j < 16; ++j) {
            y[off + j] = (uint8_t) ((qa[j] & 15) | ((qa[j + 16] & 15) << 4));
        }
        if constexpr (T == GGML_TYPE_Q5_0) {
            uint32_t qh = 0;
            for (int j = 0; j < 32; ++j) {
                qh |= (uint32_t) (qa[j] >> 4) << j;
            }
            for (int j = 0; j < 4; ++j) {
                y[2 + j] = (uint8_t) (qh >> (8*j));
            }
        }
    } else if constexpr (T == GGML_TYPE_Q53_64) {
        block_q53_64 * b = (block_q53_64 *) y;
        uint32_t qh5 = 0;
        for (int j = 0; j < 16; ++j) {
            b->qs5[j] = (uint8_t) ((qa[j] & 15) | ((qa[j + 16] & 15) << 4));
        }
        for (int j = 0; j < 32; ++j) {
            qh5 |= (uint32_t) (qa[j] >> 4) << j;
        }
        for (int j = 0; j < 4; ++j) {
            b->qh5[j] = (uint8_t) (qh5 >> (8*j));
        }
        kvq_pack_low2(qb, 32, b->qs3);   // byte j, bits 2k: value j + 8k (nuq3's layout)
        kvq_pack_high(qb, 32, b->qh3);
    } else if constexpr (T == GGML_TYPE_Q32_64) {
        block_q32_64 * b = (block_q32_64 *) y;   // q53_64's 3-bit half first, q42_64's 2-bit half last
        kvq_pack_low2(qa, 32, b->qs3);
        kvq_pack_high(qa, 32, b->qh3);
        kvq_pack_low2(qb, 32, b->qs2);
    } else {
        static_assert(T == GGML_TYPE_Q42_64, "a least-squares type");
        block_q42_64 * b = (block_q42_64 *) y;
        for (int j = 0; j < 16; ++j) {
            b->qs4[j] = (uint8_t) (qa[j] | (qa[j + 16] << 4));
        }
        kvq_pack_low2(qb, 32, b->qs2);
    }
}

// x: qk floats; y: one block. cb: the codebook (nuq types; never NULL here).
template <ggml_type T>
KVQ_HD void kvq_quantize_block(const float * x, uint8_t * y, const int8_t * cb) {
    constexpr int qk = kvq_traits<T>::qk;
    if constexpr (kvq_is_lsq<T>()) {
        // one least-squares search per 32 values (native/ggml/lsq.c, q53.c): 4 or 5 bits, then keys' 2 or 3
        uint8_t qa[32], qb[32];
        kvq_lsq_block(x, kvq_lsq_half_a<T>(), y, qa);
        if constexpr (qk == 64) {
            kvq_lsq_block(x + 32, kvq_lsq_half_b<T>(), y + 2, qb);
        }
        kvq_lsq_pack<T>(qa, qb, y);
    } else if constexpr (T == GGML_TYPE_BFP4_32 || T == GGML_TYPE_BFP4_64 || T == GGML_TYPE_BFP8_32) {
        constexpr int bits = T == GGML_TYPE_BFP8_32 ? 8 : 4;
        float amax = 0.0f;
        for (int j = 0; j < qk; ++j) {
            const float a = kvq_fabs(x[j]);
            if (a > amax) {
                amax = a;
            }
        }
        const uint8_t e = kvq_bfp_exponent<bits>(amax);
        y[0] = e;
        if constexpr (bits == 8) {
            for (int j = 0; j < qk; ++j) {
                y[1 + j] = (uint8_t) (int8_t) kvq_bfp_mantissa<127>(x[j], e);
            }
        } else {
            for (int j = 0; j < qk/2; ++j) {
                const int lo = kvq_bfp_mantissa<7>(x[j], e) + 8;
                const int hi = kvq_bfp_mantissa<7>(x[j + qk/2], e) + 8;
                y[1 + j] = (uint8_t) (lo | (hi << 4));
            }
        }
    } else {
        constexpr int n_codes = kvq_traits<T>::ncodes;
        constexpr bool outl   = kvq_traits<T>::outl;
        uint8_t idx[qk];
        const int   oi = outl ? ggml_kvq_nuq_outlier(x, qk) : -1;
        const float d  = kvq_nuq_index<n_codes>(x, qk, oi, cb, idx);
        kvq_put_f16(y, d);
        if constexpr (T == GGML_TYPE_NUQ4) {
            for (int j = 0; j < qk/2; ++j) {
                y[2 + j] = (uint8_t) (idx[j] | (idx[j + qk/2] << 4));
            }
        } else if constexpr (!outl) {       // nuq3 / nuq2 and their blocks of 64
            kvq_pack_low2(idx, qk, y + 2);
            if constexpr (n_codes == 8) {
                kvq_pack_high(idx, qk, y + 2 + qk/4);
            }
        } else {
            kvq_put_f16(y + 2, ggml_kvq_nuq_ov(x[oi]));   // NaN -> 0, clamped to +-65504
            y[4] = (uint8_t) oi;
            kvq_pack_low2(idx, qk, y + 5);
            if constexpr (T == GGML_TYPE_NUQ3O) {
                kvq_pack_high(idx, qk, y + 5 + qk/4);
            }
        }
    }
}

// ---- dequantize ---------------------------------------------------------------------------

// the halves' shared fields (keys in halves): N values from value j of a 3-bit half of 32 (q53_64's second half,
// q32_64's first: low bits as nuq3's, the third bit in qh) or of a 2-bit half (q42_64's and q32_64's second), each
// with its f16 scale d; as native/ggml/q53.c's q53_get3 / q53_get2
template <int N>
KVQ_HD void kvq_half3(const uint8_t * qs, const uint8_t * qh, const uint8_t * d, int j, float * out) {
    const float s = kvq_f16_bytes(d);
KVQ_UNROLL
    for (int l = 0; l < N; ++l) {
        const int jj = j + l;
        const int v  = ((qs[jj % 8] >> (2*(jj / 8))) & 3) | (((qh[jj / 8] >> (jj % 8)) & 1) << 2);
        out[l] = (float) (v - 4)*s;
    }
}

template <int N>
KVQ_HD void kvq_half2(const uint8_t * qs, const uint8_t * d, int j, float * out) {
    const float s = kvq_f16_bytes(d);
KVQ_UNROLL
    for (int l = 0; l < N; ++l) {
        const int jj = j + l;
        out[l] = (float) (((qs[jj % 8] >> (2*(jj / 8))) & 3) - 2)*s;
    }
}

// N consecutive values x[i0 .. i0+N) of a row (N divides the block and i0 % N == 0).
// c: the codebook as floats (nuq types), ignored otherwise.
template <ggml_type T, int N>
KVQ_HD void kvq_dequantize(const uint8_t * row, int i0, const float * c, float * out) {
    if constexpr (T == GGML_TYPE_F16) {
KVQ_UNROLL
        for (int l = 0; l < N; ++l) {
            out[l] = kvq_f16_bytes(row + 2*(i0 + l));
        }
    } else {
        constexpr int qk = kvq_traits<T>::qk;
        static_assert(qk % N == 0, "N must divide the block");
        const uint8_t * b = row + (i0 / qk) * kvq_traits<T>::bs;
        const int       j = i0 % qk;
        if constexpr (T == GGML_TYPE_BFP4_32 || T == GGML_TYPE_BFP4_64) {
            const float d  = ggml_kvq_e8m0_to_fp32(b[0]);
            const int   sh = j < qk/2 ? 0 : 4;
            const int   jj = j % (qk/2);
KVQ_UNROLL
            for (int l = 0; l < N; ++l) {
                out[l] = d * (float) (((b[1 + jj + l] >> sh) & 0x0F) - 8);
            }
        } else if constexpr (T == GGML_TYPE_BFP8_32) {
            const float d = ggml_kvq_e8m0_to_fp32(b[0]);
KVQ_UNROLL
            for (int l = 0; l < N; ++l) {
                out[l] = d * (float) (int8_t) b[1 + j + l];
            }
        } else if constexpr (T == GGML_TYPE_Q8_0) {
            const float d = kvq_f16_bytes(b);
KVQ_UNROLL
            for (int l = 0; l < N; ++l) {
                out[l] = d * (float) (int8_t) b[2 + j + l];
            }
        } else if constexpr (T == GGML_TYPE_Q53_64) {
            const block_q53_64 * q = (const block_q53_64 *) b;   // N values lie in one half (N divides 32)
            if (j < 32) {
                const float d = kvq_f16_bytes(q->d5);
KVQ_UNROLL
                for (int l = 0; l < N; ++l) {
                    const int jj = j + l;
                    const int lo = jj < 16 ? q->qs5[jj] & 15 : q->qs5[jj - 16] >> 4;
                    out[l] = (float) ((lo | (((q->qh5[jj / 8] >> (jj % 8)) & 1) << 4)) - 16)*d;
                }
            } else {
                kvq_half3<N>(q->qs3, q->qh3, q->d3, j - 32, out);
            }
        } else if constexpr (T == GGML_TYPE_Q42_64) {
            const block_q42_64 * q = (const block_q42_64 *) b;
            if (j < 32) {
                const float d = kvq_f16_bytes(q->d4);
KVQ_UNROLL
                for (int l = 0; l < N; ++l) {
                    const int jj = j + l;
                    out[l] = (float) ((jj < 16 ? q->qs4[jj] & 15 : q->qs4[jj - 16] >> 4) - 8)*d;
                }
            } else {
                kvq_half2<N>(q->qs2, q->d2, j - 32, out);
            }
        } else if constexpr (T == GGML_TYPE_Q32_64) {
            const block_q32_64 * q = (const block_q32_64 *) b;
            if (j < 32) {
                kvq_half3<N>(q->qs3, q->qh3, q->d3, j, out);
            } else {
                kvq_half2<N>(q->qs2, q->d2, j - 32, out);
            }
        } else if constexpr (T == GGML_TYPE_NUQ4) {
            const float d  = kvq_f16_bytes(b);
            const int   sh = j < 16 ? 0 : 4;
            const int   jj = j % 16;
KVQ_UNROLL
            for (int l = 0; l < N; ++l) {
                out[l] = d * c[(b[2 + jj + l] >> sh) & 0x0F];
            }
        } else {
            // 2-bit fields: byte j % (qk/4), bits 2*(j / (qk/4)); nuq3*: bit j of qh
            constexpr int  q    = qk / 4;
            constexpr bool outl = kvq_traits<T>::outl;
            constexpr bool hi   = kvq_traits<T>::ncodes == 8;
            const float d   = kvq_f16_bytes(b);
            const int   off = outl ? 5 : 2;
            const int   sh  = 2 * (j / q);
            const int   jj  = j % q;
KVQ_UNROLL
            for (int l = 0; l < N; ++l) {
                int k = (b[off + jj + l] >> sh) & 3;
                if constexpr (hi) {
                    k |= ((b[off + q + (j + l) / 8] >> ((j + l) % 8)) & 1) << 2;
                }
                out[l] = d * c[k];
            }
            if constexpr (outl) {
                const int oi = b[4];
                if (oi >= j && oi < j + N) {
                    out[oi - j] = kvq_f16_bytes(b + 2);
                }
            }
        }
    }
}
