// pykvq: KV-cache quantization types and hooks for ggml / llama.cpp.
//
// Everything pykvq adds to ggml is declared here; the bodies live next to this
// header in native/, and native/patches/ wires them into the pinned tree.
#pragma once

#include "ggml.h"
#include "ggml-kvq-types.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// the small inline helpers below are shared with the CUDA kernels (native/ggml/cuda/kvq-codec.cuh)
#if defined(__CUDACC__)
#define GGML_KVQ_HD static inline __host__ __device__
#else
#define GGML_KVQ_HD static inline
#endif

#define GGML_KVQ_VERSION "0.2.0"

// Version string of the pykvq native code compiled into this ggml.
// Reported in llama_print_system_info() as "KVQ : version = ... |".
GGML_API const char * ggml_kvq_version(void);

//
// Block floating point (bfp*): integer mantissas sharing one power-of-two
// exponent per block. The rule (pykvq/ref/bfp.py is the reference):
//   amax = max |x| of the block (NaN counts as 0)
//   amax == 0       -> e = 0, all mantissas 0
//   amax is inf     -> s = SMAX (mantissas saturate)
//   otherwise       -> frexp(amax) = f * 2^E, f in [0.5, 1)
//                      s = E - (b-1) + (f >= (M + 0.5) / 2^(b-1))
//                      i.e. the smallest s with rint(amax / 2^s) <= M
//   s clamped to [-127, SMAX], stored as e = s + 127 (E8M0, like MXFP4)
//   m = clamp(rint(x * 2^-s), -M, M)   (round half to even; NaN -> 0)
//   x' = m * 2^(e - 127)
// with b the mantissa bits, M = 2^(b-1) - 1 (7 for bfp4, 127 for bfp8) and
// SMAX = 129 - b (125 / 121): the largest s with M * 2^s finite, so no block decodes
// to inf; |x| >= (M + 1/2) * 2^SMAX (about 3e38) and +-inf saturate to +-M * 2^SMAX.
//

#define QK_BFP32 32
#define QK_BFP64 64

// 4-bit mantissas are stored offset by 8 (nibble = m + 8, m in [-7, 7]);
// byte j holds element j in its low nibble and element j + QK/2 in its high one.
typedef struct {
    uint8_t e;                // shared exponent, E8M0
    uint8_t qs[QK_BFP32/2];   // nibbles
} block_bfp4_32;              // 17 bytes per 32 values: 4.25 bits/value

typedef struct {
    uint8_t e;
    uint8_t qs[QK_BFP64/2];
} block_bfp4_64;              // 33 bytes per 64 values: 4.125 bits/value

typedef struct {
    uint8_t e;
    int8_t  qs[QK_BFP32];     // mantissas in [-127, 127]
} block_bfp8_32;              // 33 bytes per 32 values: 8.25 bits/value

GGML_API void quantize_row_bfp4_32_ref(const float * x, block_bfp4_32 * y, int64_t k);
GGML_API void quantize_row_bfp4_64_ref(const float * x, block_bfp4_64 * y, int64_t k);
GGML_API void quantize_row_bfp8_32_ref(const float * x, block_bfp8_32 * y, int64_t k);

GGML_API void dequantize_row_bfp4_32(const block_bfp4_32 * x, float * y, int64_t k);
GGML_API void dequantize_row_bfp4_64(const block_bfp4_64 * x, float * y, int64_t k);
GGML_API void dequantize_row_bfp8_32(const block_bfp8_32 * x, float * y, int64_t k);

// 2^(e - 127) for an E8M0 exponent byte (e = 0 gives the subnormal 2^-127).
GGML_KVQ_HD float ggml_kvq_e8m0_to_fp32(uint8_t e) {
    union { uint32_t u; float f; } v;
    v.u = e == 0 ? 0x00400000u : (uint32_t) e << 23;
    return v.f;
}

//
// Non-uniform quantization (nuq*): one f16 scale d per block and, per value, an
// index into a codebook c of 2^bits sorted int8 entries; x ~ d * c[idx].
// The rule (pykvq/ref/nuq.py is the reference):
//   amax = max |x| of the block (NaN counts as 0; inf counts)
//   d    = min(amax / 127, 65504) (float32: the largest finite f16, so fp16(d) is never inf)
//   id   = 1/d, or 0 when d <= 2^-25 (fp16(d) == 0: the block decodes to 0 anyway)
//   v    = x * id (float32; a NaN x is read as 0)
//   idx  = #{ j : v > m_j },  m_j = (c_j + c_{j+1}) / 2
//          (nearest entry, a tie goes to the lower one)
//   stored: fp16(d) (round to nearest even), idx;  x' = float(fp16(d)) * c[idx]
// Outlier variants (nuq3o, nuq2o; blocks of 64) keep the block's largest |x|
// (first of equals) as f16: position oi and value ov = fp16(clamp(x[oi], +-65504)),
// NaN -> 0; the dense part is quantized with x[oi] replaced by 0, and x'[oi] = float(ov).
// So no block decodes to inf or NaN: |x| beyond 65504 * 127 (dense) or 65504
// (outlier) and +-inf saturate (docs/FORMATS.md, "Edge inputs").
//
// Codebooks: 2^bits int8 entries, strictly ascending, each in [-127, 127]. They
// reach the kernels through the op_params of the graph node (below); a node
// without one uses the type's fallback codebook (GGML_KVQ_NUQ_FALLBACK_*).
//

#define QK_NUQ  32
#define QK_NUQO 64

// d and ov are f16 bit patterns stored as bytes (little endian), so no struct has padding.
typedef struct {
    uint8_t d[2];
    uint8_t qs[QK_NUQ/2];     // byte j: idx j (low nibble), idx j+16 (high nibble)
} block_nuq4;                 // 18 bytes per 32 values: 4.5 bits/value

typedef struct {
    uint8_t d[2];
    uint8_t qs[QK_NUQ/4];     // byte j, bits 2k..2k+1: idx(j + 8k) & 3, k = 0..3
    uint8_t qh[QK_NUQ/8];     // bit i of the little-endian 32-bit word: idx(i) >> 2
} block_nuq3;                 // 14 bytes per 32 values: 3.5 bits/value

typedef struct {
    uint8_t d[2];
    uint8_t qs[QK_NUQ/4];     // as nuq3's qs
} block_nuq2;                 // 10 bytes per 32 values: 2.5 bits/value

typedef struct {
    uint8_t d[2];
    uint8_t ov[2];            // the outlier's value, f16
    uint8_t oi;               // the outlier's position, 0..63
    uint8_t qs[QK_NUQO/4];    // byte j, bits 2k..2k+1: idx(j + 16k) & 3, k = 0..3
    uint8_t qh[QK_NUQO/8];    // bit i of the little-endian 64-bit word: idx(i) >> 2
} block_nuq3o;                // 29 bytes per 64 values: 3.625 bits/value

typedef struct {
    uint8_t d[2];
    uint8_t ov[2];
    uint8_t oi;
    uint8_t qs[QK_NUQO/4];    // as nuq3o's qs
} block_nuq2o;                // 21 bytes per 64 values: 2.625 bits/value

// nuq3 / nuq2 with one scale per 64 values and no outlier (values: after the online Hadamard a head's values share
// one spread, so a scale per 32 buys little; these are the cheaper steps of the V ladder)
typedef struct {
    uint8_t d[2];
    uint8_t qs[QK_NUQO/4];    // as nuq3o's qs
    uint8_t qh[QK_NUQO/8];    // as nuq3o's qh
} block_nuq3_64;              // 26 bytes per 64 values: 3.25 bits/value

typedef struct {
    uint8_t d[2];
    uint8_t qs[QK_NUQO/4];    // as nuq3o's qs
} block_nuq2_64;              // 18 bytes per 64 values: 2.25 bits/value

#ifdef __cplusplus
#define GGML_KVQ_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define GGML_KVQ_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif
GGML_KVQ_STATIC_ASSERT(sizeof(block_nuq4)  == 18, "block_nuq4 size");
GGML_KVQ_STATIC_ASSERT(sizeof(block_nuq3)  == 14, "block_nuq3 size");
GGML_KVQ_STATIC_ASSERT(sizeof(block_nuq2)  == 10, "block_nuq2 size");
GGML_KVQ_STATIC_ASSERT(sizeof(block_nuq3o) == 29, "block_nuq3o size");
GGML_KVQ_STATIC_ASSERT(sizeof(block_nuq2o) == 21, "block_nuq2o size");
GGML_KVQ_STATIC_ASSERT(sizeof(block_nuq3_64) == 26, "block_nuq3_64 size");
GGML_KVQ_STATIC_ASSERT(sizeof(block_nuq2_64) == 18, "block_nuq2_64 size");

// tcq3_64 / tcq2_64 (pykvq/ref/tcq.py, native/ggml/tcq.c): trellis-coded quantization of a block of 64 values.
// The block stores k bits per value (k = 3, 2), a little-endian bit stream whose value j is bits [kj, kj + k); value
// j reads the 8-bit window of the stream that ends with its own bits, bits [kj + k - 8, kj + k) taken around the
// block (tail-biting), as its state s, and is d * (A[s >> 4] + B[s & 15]) / 4096 with the type's two tables of 16.
// So a value's level depends on its predecessors' bits too: the encoder picks the whole block's path through the
// 256 states (Viterbi) with the least squared error, which a scalar code of the same bits cannot reach (~1.4x less
// squared error than nuq2_64 / nuq3_64 on Gaussian values). Encoding costs two passes of 256 states x 64 steps.
// The scale is one byte c (ggml_kvq_tcq_scale: 2^((c - 159)/8), 0 for c = 0; 1/8 octave apart over 2^-19.75 ..
// 2^12): a trellis run's scale is positive, and rounding it to the nearest step costs ~1% of a 2-bit block's squared
// error where an f16 scale costs 0.125 bits/value (Qwen2.5-Coder-1.5B, --bits 3 --cpu-types: 0.0108 -> 0.0092 KLD).
#define QK_TCQ 64
typedef struct {
    uint8_t d;                // scale code (ggml_kvq_tcq_scale)
    uint8_t qs[QK_TCQ*3/8];   // the 3-bit stream
} block_tcq3_64;              // 25 bytes per 64 values: 3.125 bits/value

typedef struct {
    uint8_t d;
    uint8_t qs[QK_TCQ*2/8];   // the 2-bit stream
} block_tcq2_64;              // 17 bytes per 64 values: 2.125 bits/value

GGML_KVQ_STATIC_ASSERT(sizeof(block_tcq3_64) == 25, "block_tcq3_64 size");
GGML_KVQ_STATIC_ASSERT(sizeof(block_tcq2_64) == 17, "block_tcq2_64 size");

// tcq25_64: one trellis whose even values take 3 bits and odd values 2 (value j's bits start at 5(j/2) + 3(j%2) of a
// 160-bit stream; its state is still the 8-bit window ending with its bits, its level from its parity's own two
// tables). A trellis between tcq2_64 and tcq3_64 in bits, not a mix of them: on unit Gaussian blocks 0.043 squared
// error, where tcq2_64 and tcq3_64 in equal parts (the same bits) give 0.052.
typedef struct {
    uint8_t d;                // scale code (ggml_kvq_tcq_scale)
    uint8_t qs[QK_TCQ*5/16];  // the stream: 3 + 2 bits per pair of values
} block_tcq25_64;             // 21 bytes per 64 values: 2.625 bits/value

GGML_KVQ_STATIC_ASSERT(sizeof(block_tcq25_64) == 21, "block_tcq25_64 size");

// tcq35_64: the same with 4 and 3 bits by turns (value j's bits start at 7(j/2) + 4(j%2) of a 224-bit stream).
// A 4-bit step's window remembers only the value before it, so 4 bits in every step would read back no better than
// q4_0; by turns with 3 the path keeps its memory: 0.0133 squared error on unit Gaussian blocks (tcq3_64: 0.0227).
typedef struct {
    uint8_t d;                // scale code (ggml_kvq_tcq_scale)
    uint8_t qs[QK_TCQ*7/16];  // the stream: 4 + 3 bits per pair of values
} block_tcq35_64;             // 29 bytes per 64 values: 3.625 bits/value

GGML_KVQ_STATIC_ASSERT(sizeof(block_tcq35_64) == 29, "block_tcq35_64 size");

// tcq3_128 / tcq2_128: a head row of 128 as two runs of 64, each a tail-biting path and stream of tcq3_64's / tcq2_64's
// rule and tables, under one f16 scale (the unit-RMS factor and the least-squares scale taken over all 128). A 128-wide
// Hadamard spreads the row evenly, so the second scale buys little: 0.125 bits/value less for ~2-3% more squared
// error on Gaussian rows.
#define QK_TCQ128 128
typedef struct {
    uint8_t d[2];                // f16 scale of both runs
    uint8_t qs[QK_TCQ128*3/8];   // run 0's 3-bit stream, then run 1's
} block_tcq3_128;                // 50 bytes per 128 values: 3.125 bits/value

typedef struct {
    uint8_t d[2];
    uint8_t qs[QK_TCQ128*2/8];
} block_tcq2_128;                // 34 bytes per 128 values: 2.125 bits/value

GGML_KVQ_STATIC_ASSERT(sizeof(block_tcq3_128) == 50, "block_tcq3_128 size");
GGML_KVQ_STATIC_ASSERT(sizeof(block_tcq2_128) == 34, "block_tcq2_128 size");

// q53_64 (pykvq/ref/q53.py, native/ggml/q53.c): a block of 64 values in 4.5 bits/value, split unevenly: the
// first 32 in 5 bits (q5_0's rule and layout), the last 32 in 3 bits (the same rule with 8 levels, nuq3's
// layout), each half with its own f16 scale. For a key cache laid out so that the important channels of
// every 64 come first (a pre-RoPE file converted for it).
#define QK_Q53 64

typedef struct {
    uint8_t d5[2];            // scale of values 0..31: x = d5 * (q5 - 16)
    uint8_t d3[2];            // scale of values 32..63: x = d3 * (q3 - 4)
    uint8_t qh5[4];           // bit i of the little-endian 32-bit word: q5(i) >> 4
    uint8_t qs5[16];          // byte j: q5(j) & 15 (low nibble), q5(j+16) & 15 (high)
    uint8_t qs3[8];           // byte j, bits 2k..2k+1: q3(j + 8k) & 3, k = 0..3
    uint8_t qh3[4];           // bit i of the little-endian 32-bit word: q3(i) >> 2
} block_q53_64;               // 36 bytes per 64 values: 4.5 bits/value

GGML_KVQ_STATIC_ASSERT(sizeof(block_q53_64) == 36, "block_q53_64 size");

// q42_64: the same split one bit lower, 3.5 bits/value: the first 32 values in 4 bits (q4_0's levels and nibble
// order), the last 32 in 2 bits (4 levels, nuq2's order), each half with its own f16 scale
// (pykvq/ref/q53.py: 4 / 2 takes 59% off the error of uniform 3-bit keys in the study, docs/RESULTS.md).
#define QK_Q42 64

typedef struct {
    uint8_t d4[2];            // scale of values 0..31: x = d4 * (q4 - 8)
    uint8_t d2[2];            // scale of values 32..63: x = d2 * (q2 - 2)
    uint8_t qs4[16];          // byte j: q4(j) (low nibble), q4(j+16) (high)
    uint8_t qs2[8];           // byte j, bits 2k..2k+1: q2(j + 8k), k = 0..3
} block_q42_64;               // 28 bytes per 64 values: 3.5 bits/value

GGML_KVQ_STATIC_ASSERT(sizeof(block_q42_64) == 28, "block_q42_64 size");

// q32_64: the split at 3.0 bits/value: the first 32 values in 3 bits, the last 32 in 2 bits (q53_64's 3-bit half and
// q42_64's 2-bit half), each half with its own f16 scale. It fills the key ladder's step from 2.625 bits (nuq2o) to
// 3.5 (q42_64), across which the keys' error falls ~16x (docs/RESULTS-BY-DATE.md, 2026-11-29 late night).
#define QK_Q32 64

typedef struct {
    uint8_t d3[2];            // scale of values 0..31: x = d3 * (q3 - 4)
    uint8_t d2[2];            // scale of values 32..63: x = d2 * (q2 - 2)
    uint8_t qs3[8];           // byte j, bits 2k..2k+1: q3(j + 8k) & 3, k = 0..3
    uint8_t qh3[4];           // bit i of the little-endian 32-bit word: q3(i) >> 2
    uint8_t qs2[8];           // byte j, bits 2k..2k+1: q2(j + 8k), k = 0..3
} block_q32_64;               // 24 bytes per 64 values: 3.0 bits/value

GGML_KVQ_STATIC_ASSERT(sizeof(block_q32_64) == 24, "block_q32_64 size");

// q4t2_64: q42_64 with its 2-bit half trellis-coded, 3.375 bits/value: the first 32 values as q42_64's (q4_0's levels,
// a least-squares scale), the last 32 as one tail-biting block of tcq2_64's rule and tables over 32 values (value j's
// state is the 8-bit window of the half's 64-bit stream ending at its bits). Keys split by importance: SmolLM2's at
// 4096 tokens 0.0039 KLD against q42_64's 0.0049 in the fake-quant study (docs/RESULTS-BY-DATE.md, 2026-12-01).
#define QK_Q4T2 64

typedef struct {
    uint8_t d4[2];            // f16 scale of values 0..31: x = d4 * (q4 - 8)
    uint8_t d2;               // scale code of values 32..63 (ggml_kvq_tcq_scale): x = d2 * level(state)
    uint8_t qs4[16];          // byte j: q4(j) (low nibble), q4(j+16) (high)
    uint8_t qs2[8];           // the 2-bit stream of values 32..63, value 32 + j's bits at 2j
} block_q4t2_64;              // 27 bytes per 64 values: 3.375 bits/value

GGML_KVQ_STATIC_ASSERT(sizeof(block_q4t2_64) == 27, "block_q4t2_64 size");

// t32_64: q32_64's split with both halves trellis-coded, 2.75 bits/value: the first 32 values one tail-biting block of
// tcq3_64's rule and tables over 32 values, the last 32 one of tcq2_64's (as q4t2_64's second half). SmolLM2's keys
// at 4096 tokens: 0.0100 KLD against q32_64's 0.0168 in the fake-quant study (docs/RESULTS-BY-DATE.md, 2026-12-01).
#define QK_T32 64

typedef struct {
    uint8_t d3;               // scale code of values 0..31 (ggml_kvq_tcq_scale): x = d3 * level3(state)
    uint8_t d2;               // scale code of values 32..63: x = d2 * level2(state)
    uint8_t qs3[12];          // the 3-bit stream of values 0..31, value j's bits at 3j
    uint8_t qs2[8];           // the 2-bit stream of values 32..63, value 32 + j's bits at 2j
} block_t32_64;               // 22 bytes per 64 values: 2.75 bits/value

GGML_KVQ_STATIC_ASSERT(sizeof(block_t32_64) == 22, "block_t32_64 size");

// Fallback codebooks (pykvq/ref/nuq.py FALLBACK): Lloyd-Max centroids of Gaussian
// blocks of 32 normalised by their absmax to [-127, 127], rounded.
#define GGML_KVQ_NUQ_FALLBACK_4 { -123, -98, -78, -61, -46, -32, -19, -6, 6, 19, 32, 46, 61, 78, 98, 123 }
#define GGML_KVQ_NUQ_FALLBACK_3 { -112, -71, -40, -13, 13, 40, 71, 112 }
#define GGML_KVQ_NUQ_FALLBACK_2 { -84, -25, 25, 84 }

#define GGML_KVQ_NUQ_MAX_CODES 16

// the family of one of pykvq's types (ggml-kvq-types.h), GGML_KVQ_FAMILY_NONE for any other type
#define GGML_KVQ_FAMILY_CASE(name, NAME, id, qk, family, ...) case GGML_TYPE_##NAME: return GGML_KVQ_FAMILY_##family;
GGML_KVQ_HD enum ggml_kvq_family ggml_kvq_type_family(enum ggml_type type) {
    switch (type) {
        GGML_KVQ_TYPES(GGML_KVQ_FAMILY_CASE, 0)
        default: return GGML_KVQ_FAMILY_NONE;
    }
}

// any of pykvq's types
GGML_KVQ_HD bool ggml_kvq_type_is_kvq(enum ggml_type type) {
    return ggml_kvq_type_family(type) != GGML_KVQ_FAMILY_NONE;
}

GGML_KVQ_HD bool ggml_kvq_type_is_nuq(enum ggml_type type) {
    return ggml_kvq_type_family(type) == GGML_KVQ_FAMILY_NUQ;
}

// values per block and whether a block keeps its largest value exactly (the table's qk and outl columns)
#define GGML_KVQ_QK_CASE(name, NAME, id, qk, ...) case GGML_TYPE_##NAME: return qk;
GGML_KVQ_HD int ggml_kvq_type_qk(enum ggml_type type) {
    switch (type) {
        GGML_KVQ_TYPES(GGML_KVQ_QK_CASE, 0)
        default: return 0;
    }
}
#define GGML_KVQ_OUTL_CASE(name, NAME, id, qk, family, vdt, VDT, cuda, codes, outl, ...) case GGML_TYPE_##NAME: return outl;
GGML_KVQ_HD bool ggml_kvq_type_outl(enum ggml_type type) {
    switch (type) {
        GGML_KVQ_TYPES(GGML_KVQ_OUTL_CASE, 0)
        default: return false;
    }
}

// the pykvq types native/ggml/cuda has kernels for (the table's cuda column)
#define GGML_KVQ_CUDA_CASE(name, NAME, id, qk, family, vdt, VDT, cuda, ...) GGML_KVQ_IF(cuda)(case GGML_TYPE_##NAME: return true;)
GGML_KVQ_HD bool ggml_kvq_type_has_cuda(enum ggml_type type) {
    switch (type) {
        GGML_KVQ_TYPES(GGML_KVQ_CUDA_CASE, 0)
        default: return false;
    }
}

GGML_API bool           ggml_kvq_is_nuq(enum ggml_type type);
GGML_API int            ggml_kvq_nuq_n_codes(enum ggml_type type);    // 16 / 8 / 4; 0 for other types
GGML_API const int8_t * ggml_kvq_nuq_fallback(enum ggml_type type);   // NULL for other types
GGML_API int            ggml_kvq_nuq_block(enum ggml_type type);      // 32 / 64; 0 for other types
GGML_API size_t         ggml_kvq_nuq_type_size(enum ggml_type type);  // bytes per block; 0 for other types
// position of the block's largest |x| (first of equals; NaN counts as 0, so an all-zero/NaN
// block gives 0): the kept outlier of nuq3o / nuq2o, shared by the reference and the CPU kernels
GGML_KVQ_HD int ggml_kvq_nuq_outlier(const float * x, int n) {
    float amax = 0.0f;
    int   oi   = 0;
    for (int i = 0; i < n; ++i) {
        const float a = x[i] < 0 ? -x[i] : x[i];
        if (a > amax) {
            amax = a;
            oi   = i;
        }
    }
    return oi;
}

// The edge-input pieces of the nuq rule, shared by the reference, the CPU kernels and CUDA.
#define GGML_KVQ_F16_MAX 65504.0f
// the block scale amax/127 clamped to the largest finite f16 (+inf -> 65504)
GGML_KVQ_HD float ggml_kvq_nuq_clamp_d(float d) {
    return d > GGML_KVQ_F16_MAX ? GGML_KVQ_F16_MAX : d;
}
// whether id = 1/d is used: fp16(d) is 0 for d <= 2^-25, and 1/d of an f32 subnormal d may be inf
GGML_KVQ_HD bool ggml_kvq_nuq_use_id(float d) {
    return d > 2.98023223876953125e-8f;   // 2^-25, exact
}
// the outlier's value as stored: NaN -> 0, clamped to +-65504 (integer NaN test: fast-math safe)
GGML_KVQ_HD float ggml_kvq_nuq_ov(float x) {
    union { float f; uint32_t u; } v = { x };
    if ((v.u & 0x7FFFFFFFu) > 0x7F800000u) {
        return 0.0f;
    }
    return x > GGML_KVQ_F16_MAX ? GGML_KVQ_F16_MAX : x < -GGML_KVQ_F16_MAX ? -GGML_KVQ_F16_MAX : x;
}

// Store one block from its indices (idx[0..block)), d, and (outlier types) ov / oi;
// shared by the reference and the CPU kernels, so every variant writes the same bytes.
// ov is the input value x[oi]: the pack applies ggml_kvq_nuq_ov.
GGML_API void           ggml_kvq_nuq_pack(enum ggml_type type, const uint8_t * idx, float d, float ov, int oi, void * blk);

//
// Codebooks in op_params. Every op that reads or writes a nuq tensor carries up
// to two codebooks in its op_params, after the words ggml itself uses there
// (FLASH_ATTN_EXT: [0..4] = scale, max_bias, softcap, prec, n_kv_max;
// MUL_MAT: [0] prec, [1] hint):
//   bytes [20, 36)   slot A: 16 int8, entries past n_codes are 0
//   bytes [36, 52)   slot B: 16 int8
//   int32 op_params[13] = GGML_KVQ_CB_MAGIC | presence bits (bit 0: slot A, bit 1: slot B)
// A slot that is not present means: the fallback codebook of the kernel's type.
// Kernels read them as follows: quantizing (from_float, from_float_ref) and
// vec_dot use slot A, dequantizing (to_float) uses slot B. So
//   - a non-FA op with one nuq tensor (SET_ROWS, CPY/DUP in either direction,
//     GET_ROWS, MUL_MAT with a nuq src0): both slots hold that tensor's codebook
//     (ggml_kvq_set_codebook);
//   - FLASH_ATTN_EXT: slot A = K's codebook (vec_dot), slot B = V's (to_float)
//     (ggml_kvq_set_codebooks_fa).
// The CPU backend loads them into thread-local storage before each node
// (ggml_kvq_cpu_bind, ggml-kvq-cpu.h); backends that do not read them must not
// claim nuq types in supports_op.
//
#define GGML_KVQ_CB_OFFS_A  20
#define GGML_KVQ_CB_OFFS_B  36
#define GGML_KVQ_CB_TAG     13
#define GGML_KVQ_CB_MAGIC   0x4B510000   // "QK" in the upper half; presence in bits 0-1
#define GGML_KVQ_CB_MASK    0xFFFF0000
GGML_KVQ_STATIC_ASSERT(GGML_KVQ_CB_OFFS_A >= 5 * 4, "codebooks must not overlap op_params[0..4]");
GGML_KVQ_STATIC_ASSERT(GGML_KVQ_CB_OFFS_B + GGML_KVQ_NUQ_MAX_CODES <= GGML_KVQ_CB_TAG * 4, "slot B overlaps the tag");
GGML_KVQ_STATIC_ASSERT((GGML_KVQ_CB_TAG + 1) * 4 <= GGML_MAX_OP_PARAMS, "op_params too small");

// cb: NULL for "not present" (fallback), else n_codes entries of the nuq tensor's
// type; checked (strictly ascending, in [-127, 127]); aborts otherwise.
// ggml_kvq_set_codebook aborts when the node has no nuq tensor (node, src[0..2]);
// ggml_kvq_set_codebooks_fa drops cb_k / cb_v when K / V is not a nuq type.
GGML_API void ggml_kvq_set_codebook(struct ggml_tensor * node, const int8_t * cb);
GGML_API void ggml_kvq_set_codebooks_fa(struct ggml_tensor * fa, const int8_t * cb_k, const int8_t * cb_v);
// The two slots of a node: returns the presence bits (0 when the node carries none);
// cb_a / cb_b receive 16 entries each (zeros where not present).
GGML_API unsigned ggml_kvq_get_codebooks(const struct ggml_tensor * node, int8_t * cb_a, int8_t * cb_b);
// true when cb is a valid codebook of n entries
GGML_API bool ggml_kvq_nuq_codebook_ok(const int8_t * cb, int n);

//
// Pre-RoPE key cache (FLASH_ATTN_EXT). K holds c = (k - mean) / scale per channel,
// taken before RoPE, optionally turned by an orthonormal Walsh-Hadamard matrix H (Sylvester
// order) per block of n_rot_h channels: r = H c; attention restores c = H r, k = c*scale + mean
// and rotates k at each cell's own position, so a K-shift only changes positions. The node carries
//   src[5]  I32 [>= n_kv, n_stream]   position of each K cell (any order: cells are
//                                      not consecutive after removal or shifts)
//   src[6]  F32 [DK, n_head_kv]        mean            (contiguous)
//   src[7]  F32 [DK, n_head_kv]        scale           (contiguous)
//   src[8]  F32 [n_dims/2, n_head_kv]  angular frequency w of each rotary pair: the
//                                      angle at position p is p*w (freq_base, freq_scale,
//                                      YaRN ramp, rope_freqs and K-sort factors folded in;
//                                      ggml_kvq_rope_freqs)
//   int32 op_params[14] = GGML_KVQ_PREROPE_MAGIC | log2(n_rot_h) << 20 | mode << 16 | h_skip << 12 | n_dims
//                         (mode: 0 NORM, 2 NEOX; n_rot_h = 0: no Hadamard, else 2^k dividing DK;
//                         h_skip = 0, or 1 + log2 of a butterfly stride the Hadamard leaves out: ggml_kvq_fa_set_hadamard_skip)
//   float op_params[15] = mscale (multiplies cos and sin, as ggml_rope_ext's attn_factor / YaRN)
// Channels from n_dims on are not rotated (partial rotary).
//
// Centred post-RoPE K (bit GGML_KVQ_PREROPE_CENTRED of the tag): K holds H R(p)(k - mean), the
// key rotated at its position as upstream's cache does, minus the mean rotated with it, and Q is
// H q (the online rotation of both, n_rot_h as above; 0: none). Attention reads K as a post-RoPE
// cache and adds q·R(p)mean to each score, from the pairs whose mean is non-zero: a K-shift is
// upstream's (the rotation of R(p)(k - mean) by the shift is R(p + shift)(k - mean)). src[7] is
// not read (ggml_kvq_fa_set_centred puts the mean there too).
//
#define GGML_KVQ_PREROPE_TAG    14
#define GGML_KVQ_PREROPE_MAGIC  0x52000000   // "R" in the top byte
#define GGML_KVQ_PREROPE_CENTRED 0x8000      // in the tag's n_dims field (n_dims < 4096)
#define GGML_KVQ_PREROPE_HSKIP_SHIFT 12      // 3 bits: 0, or 1 + log2 of the left-out stride
GGML_KVQ_STATIC_ASSERT(GGML_KVQ_PREROPE_TAG > GGML_KVQ_CB_TAG, "pre-RoPE words overlap the codebooks");
GGML_KVQ_STATIC_ASSERT((GGML_KVQ_PREROPE_TAG + 2) * 4 <= GGML_MAX_OP_PARAMS, "op_params too small");

GGML_API void ggml_kvq_fa_set_prerope(struct ggml_tensor * fa, struct ggml_tensor * pos, struct ggml_tensor * mean,
                                      struct ggml_tensor * scale, struct ggml_tensor * freqs,
                                      int n_dims, int mode, float mscale, int n_rot_h);
// the same contract for a centred post-RoPE K cache (src[7] = mean)
GGML_API void ggml_kvq_fa_set_centred(struct ggml_tensor * fa, struct ggml_tensor * pos, struct ggml_tensor * mean,
                                      struct ggml_tensor * freqs, int n_dims, int mode, float mscale, int n_rot_h);
// true when fa reads a pre-RoPE or a centred K cache; n_dims / mode / mscale / n_rot_h may be NULL
GGML_API bool ggml_kvq_fa_get_prerope(const struct ggml_tensor * fa, int * n_dims, int * mode, float * mscale, int * n_rot_h);
// true when fa reads a centred post-RoPE K cache
GGML_API bool ggml_kvq_fa_is_centred(const struct ggml_tensor * fa);
// Exact window (sinks and the most recent cells, kept unquantized): src[9] F16 [DK*n_head_kv + DV*n_head_kv, n_rows]
// holds per row one cell's K exactly as the cache stores it (pre-RoPE: centred, scaled, turned) followed by its V, both
// before quantization; src[5] then has ne[2] = 2 and its plane 1 gives each cell's row of src[9] (-1, or a row past
// src[9]'s: the cell is read from the quantized cache). With ne[2] = 4 the rows are read per query: plane 2 gives the
// last query position that reads each cell's row (a window of W positions: the cell's position + W - 1; a sink:
// INT32_MAX), plane 3 each query's position (entry j: query j of the stream), so every query of a prefill batch sees
// the window a decode at its position would. A pre-RoPE node only (positions do not move a row); pykvq's CPU and CUDA kernels (native/ggml/cuda/kvq-window.cuh).
// rows are f16 or q8_0 (every head's K and V on whole blocks).
GGML_API void ggml_kvq_fa_set_window(struct ggml_tensor * fa, struct ggml_tensor * rows);
// src[9] when fa reads an exact window, else NULL
GGML_API const struct ggml_tensor * ggml_kvq_fa_get_window(const struct ggml_tensor * fa);
// The node's Hadamard leaves out the butterfly at `stride` (a power of two < n_rot_h; 0: none): per block of n_rot_h
// channels it is the orthonormal Walsh-Hadamard over the other index bits, H_{n/2s} (x) I_2 (x) H_s: entry (i, j) is 0
// where i and j differ in the stride's bit, else (-1)^popcount(i & j & ~stride) / sqrt(n_rot_h/2). q53_64 keys on a 128 head: the two blocks' 5-bit halves turn
// together, and so do their 3-bit halves (llama_kvq_new_k_rot).
GGML_API void ggml_kvq_fa_set_hadamard_skip(struct ggml_tensor * fa, int stride);
GGML_API int  ggml_kvq_fa_get_hadamard_skip(const struct ggml_tensor * fa);

// The angular frequencies ggml_rope_ext uses (CPU and CUDA kernels): for pair i < n_dims/2,
// theta(p) = p * w[i], with w[i] = base^(-2i/n_dims) / ff[i] * (freq_scale*(1 - r) + r),
// r = YaRN ramp(i) * ext_factor. ff: NULL, [n_dims/2] or [n_dims/2, n_cols] (K-sort, one column
// per KV head); out: [n_dims/2, n_cols]. Returns mscale (attn_factor, YaRN-corrected).
GGML_API float ggml_kvq_rope_freqs(int n_dims, int n_ctx_orig, float freq_base, float freq_scale, float ext_factor,
                                   float attn_factor, float beta_fast, float beta_slow,
                                   const float * ff, int ff_cols, int n_cols, float * out);

// ggml-base's thread-local slots, read by the trait functions below (from_float_ref:
// slot A, to_float: slot B). NULL = not present (fallback). Set by ggml_kvq_cpu_bind.
GGML_API void ggml_kvq_bind_codebooks(const int8_t * cb_a, const int8_t * cb_b);

// Reference codecs with an explicit codebook (NULL = the fallback for the type).
GGML_API void quantize_row_nuq4_ref_cb (const float * x, void * y, int64_t k, const int8_t * cb);
GGML_API void quantize_row_nuq3_ref_cb (const float * x, void * y, int64_t k, const int8_t * cb);
GGML_API void quantize_row_nuq2_ref_cb (const float * x, void * y, int64_t k, const int8_t * cb);
GGML_API void quantize_row_nuq3o_ref_cb(const float * x, void * y, int64_t k, const int8_t * cb);
GGML_API void quantize_row_nuq2o_ref_cb(const float * x, void * y, int64_t k, const int8_t * cb);
GGML_API void quantize_row_nuq3_64_ref_cb(const float * x, void * y, int64_t k, const int8_t * cb);
GGML_API void quantize_row_nuq2_64_ref_cb(const float * x, void * y, int64_t k, const int8_t * cb);

GGML_API void dequantize_row_nuq4_cb (const void * x, float * y, int64_t k, const int8_t * cb);
GGML_API void dequantize_row_nuq3_cb (const void * x, float * y, int64_t k, const int8_t * cb);
GGML_API void dequantize_row_nuq2_cb (const void * x, float * y, int64_t k, const int8_t * cb);
GGML_API void dequantize_row_nuq3o_cb(const void * x, float * y, int64_t k, const int8_t * cb);
GGML_API void dequantize_row_nuq2o_cb(const void * x, float * y, int64_t k, const int8_t * cb);
GGML_API void dequantize_row_nuq3_64_cb(const void * x, float * y, int64_t k, const int8_t * cb);
GGML_API void dequantize_row_nuq2_64_cb(const void * x, float * y, int64_t k, const int8_t * cb);

// The trait functions: the codebook bound to the calling thread (slot A to quantize,
// slot B to dequantize), else the fallback.
GGML_API void quantize_row_nuq4_ref (const float * x, block_nuq4  * y, int64_t k);
GGML_API void quantize_row_nuq3_ref (const float * x, block_nuq3  * y, int64_t k);
GGML_API void quantize_row_nuq2_ref (const float * x, block_nuq2  * y, int64_t k);
GGML_API void quantize_row_nuq3o_ref(const float * x, block_nuq3o * y, int64_t k);
GGML_API void quantize_row_nuq2o_ref(const float * x, block_nuq2o * y, int64_t k);
GGML_API void quantize_row_nuq3_64_ref(const float * x, block_nuq3_64 * y, int64_t k);
GGML_API void quantize_row_nuq2_64_ref(const float * x, block_nuq2_64 * y, int64_t k);

GGML_API void dequantize_row_nuq4 (const block_nuq4  * x, float * y, int64_t k);
GGML_API void dequantize_row_nuq3 (const block_nuq3  * x, float * y, int64_t k);
GGML_API void dequantize_row_nuq2 (const block_nuq2  * x, float * y, int64_t k);
GGML_API void dequantize_row_nuq3o(const block_nuq3o * x, float * y, int64_t k);
GGML_API void dequantize_row_nuq2o(const block_nuq2o * x, float * y, int64_t k);
GGML_API void dequantize_row_nuq3_64(const block_nuq3_64 * x, float * y, int64_t k);
GGML_API void dequantize_row_nuq2_64(const block_nuq2_64 * x, float * y, int64_t k);

GGML_API void quantize_row_q53_64_ref(const float * x, block_q53_64 * y, int64_t k);
GGML_API void dequantize_row_q53_64(const block_q53_64 * x, float * y, int64_t k);
GGML_API void quantize_row_q42_64_ref(const float * x, block_q42_64 * y, int64_t k);
GGML_API void dequantize_row_q42_64(const block_q42_64 * x, float * y, int64_t k);
GGML_API void quantize_row_q32_64_ref(const float * x, block_q32_64 * y, int64_t k);
GGML_API void dequantize_row_q32_64(const block_q32_64 * x, float * y, int64_t k);
GGML_API void quantize_row_q4t2_64_ref(const float * x, block_q4t2_64 * y, int64_t k);
GGML_API void dequantize_row_q4t2_64(const block_q4t2_64 * x, float * y, int64_t k);
GGML_API void quantize_row_t32_64_ref(const float * x, block_t32_64 * y, int64_t k);
GGML_API void dequantize_row_t32_64(const block_t32_64 * x, float * y, int64_t k);
GGML_API void quantize_row_tcq3_64_ref(const float * x, block_tcq3_64 * y, int64_t k);
GGML_API void dequantize_row_tcq3_64(const block_tcq3_64 * x, float * y, int64_t k);
GGML_API void quantize_row_tcq2_64_ref(const float * x, block_tcq2_64 * y, int64_t k);
GGML_API void dequantize_row_tcq2_64(const block_tcq2_64 * x, float * y, int64_t k);
GGML_API void quantize_row_tcq3_128_ref(const float * x, block_tcq3_128 * y, int64_t k);
GGML_API void quantize_row_tcq2_128_ref(const float * x, block_tcq2_128 * y, int64_t k);
GGML_API void dequantize_row_tcq3_128(const block_tcq3_128 * x, float * y, int64_t k);
GGML_API void dequantize_row_tcq2_128(const block_tcq2_128 * x, float * y, int64_t k);
GGML_API void quantize_row_tcq25_64_ref(const float * x, block_tcq25_64 * y, int64_t k);
GGML_API void dequantize_row_tcq25_64(const block_tcq25_64 * x, float * y, int64_t k);
GGML_API void quantize_row_tcq35_64_ref(const float * x, block_tcq35_64 * y, int64_t k);
GGML_API void dequantize_row_tcq35_64(const block_tcq35_64 * x, float * y, int64_t k);
// a TCQ type's tables for value j of a run: A[16] then B[16], in 1/4096 (NULL for other types); its bits k_j (0 for
// other types). Only tcq25_64's and tcq35_64's depend on j (its parity).
GGML_API const int16_t * ggml_kvq_tcq_tables(enum ggml_type type, int j);
GGML_API int ggml_kvq_tcq_bits(enum ggml_type type, int j);
// values per block under one scale, the type table's qk (64; 128 for tcq3_128 / tcq2_128, two runs of 64)
GGML_API int ggml_kvq_tcq_block(enum ggml_type type);
// the rows of a TCQ type with another implementation of the path search (the CPU's SIMD one): z[n] (n <= 64, even) at
// unit RMS, read from index rot (even) on; step i takes k[i & 1] bits and the levels lut[256*(i & 1) ..]; o >= 0 the
// tail-biting overlap, o < 0 a free path; st: the n states (native/ggml/tcq.c)
typedef void (*ggml_kvq_tcq_viterbi_t)(const float * z, int n, const int k[2], const float * lut, int o, int rot, uint8_t * st);
GGML_API void ggml_kvq_quantize_row_tcq_with(enum ggml_type type, const float * x, void * y, int64_t n,
                                            ggml_kvq_tcq_viterbi_t viterbi);
// n values (n <= 64, n*k a multiple of 8) as one tail-biting block of the TCQ type tt's rule and tables (k its bits):
// the scale code d (one byte) and the k-bit stream qs[n*k/8] (the halves of q4t2_64 and t32_64); viterbi NULL: the
// reference search
GGML_API void ggml_kvq_tcq_quantize_run(enum ggml_type tt, const float * x, int n, uint8_t * d, uint8_t * qs,
                                        ggml_kvq_tcq_viterbi_t viterbi);
GGML_API void ggml_kvq_tcq_dequantize_run(enum ggml_type tt, const uint8_t * d, const uint8_t * qs, int n, float * y);
// a TCQ type's scale bytes: 1 (the code ggml_kvq_tcq_scale reads) for tcq*_64 and the runs inside q4t2_64 / t32_64,
// 2 (f16) for tcq*_128
GGML_API int ggml_kvq_tcq_scale_bytes(enum ggml_type type);
// a TCQ type's bytes per block of ggml_kvq_tcq_block values (its scale, then each run's stream)
GGML_API size_t ggml_kvq_tcq_block_bytes(enum ggml_type type);
// Row validation (the type registration seam): tcq3_128 / tcq2_128's f16 scales finite (every scale code is valid).
GGML_API bool ggml_kvq_validate_row_tcq(enum ggml_type type, const void * data, size_t nbytes);
// Row validation for ggml_validate_row_data (the type registration seam): both scales of every block finite (q53_64,
// q42_64, q32_64).
GGML_API bool ggml_kvq_validate_row_q53(enum ggml_type type, const void * data, size_t nbytes);

//
// Least-squares block scales (native/ggml/lsq.c, pykvq/ref/scale_search.py). For a block of GGML_KVQ_LSQ_N values and
// half = 2^(bits-1): q*_0's rule with its scale d = vmax/-half times the factor f_k = (35 + k)/50, k = 0 .. 25
// (0.70 .. 1.20; f_15 = 1 is q*_0's own), the one whose read-back values have the least squared error (double,
// summed in order, the first of equals). NaN is read as 0, +-inf as +-FLT_MAX, |d| saturates at 65504.
// q53_64 always encodes its halves so; q4_0 / q5_0 do where a cache write asks (ggml_kvq_set_encoder): the
// format is the stock one, so every decoder reads it unchanged.
//
#define GGML_KVQ_LSQ_N        32
#define GGML_KVQ_LSQ_N_SCALES 26
// d_out: the f16 scale's bytes; q[GGML_KVQ_LSQ_N]: levels in [0, 2*half)
GGML_API void ggml_kvq_lsq_block(const float * x, int half, uint8_t d_out[2], uint8_t * q);
GGML_API void quantize_row_q4_0_lsq(const float * x, void * y, int64_t k);
GGML_API void quantize_row_q5_0_lsq(const float * x, void * y, int64_t k);
// the rows of q4_0 / q5_0 / q53_64 / q42_64 / q32_64 with another implementation of the block rule (the CPU's SIMD one)
typedef void (*ggml_kvq_lsq_block_t)(const float * x, int half, uint8_t d_out[2], uint8_t * q);
GGML_API void ggml_kvq_quantize_row_q4_0_with(const float * x, void * y, int64_t k, ggml_kvq_lsq_block_t block);
GGML_API void ggml_kvq_quantize_row_q5_0_with(const float * x, void * y, int64_t k, ggml_kvq_lsq_block_t block);
GGML_API void ggml_kvq_quantize_row_q53_64_with(const float * x, block_q53_64 * y, int64_t k, ggml_kvq_lsq_block_t block);
GGML_API void ggml_kvq_quantize_row_q42_64_with(const float * x, block_q42_64 * y, int64_t k, ggml_kvq_lsq_block_t block);
GGML_API void ggml_kvq_quantize_row_q32_64_with(const float * x, block_q32_64 * y, int64_t k, ggml_kvq_lsq_block_t block);
// q4t2_64: the first half's scale search and the second half's path search (NULL: the reference's); t32_64: both
// halves' path search
GGML_API void ggml_kvq_quantize_row_q4t2_64_with(const float * x, block_q4t2_64 * y, int64_t k, ggml_kvq_lsq_block_t block,
                                                ggml_kvq_tcq_viterbi_t viterbi);
GGML_API void ggml_kvq_quantize_row_t32_64_with(const float * x, block_t32_64 * y, int64_t k, ggml_kvq_tcq_viterbi_t viterbi);

// The encoder a SET_ROWS into a cache tensor uses: int32 op_params[GGML_KVQ_ENC_TAG] = GGML_KVQ_ENC_MAGIC
// for least squares (ggml's SET_ROWS reads no op_params). The CPU and pykvq's CUDA kernels read it; a backend
// that does not writes the stock encoding, which is equally valid.
#define GGML_KVQ_ENC_TAG     15
#define GGML_KVQ_ENC_MAGIC   0x4C530001   // "LS", 1
enum { GGML_KVQ_ENCODER_STOCK = 0, GGML_KVQ_ENCODER_LSQ = 1 };
GGML_KVQ_STATIC_ASSERT((GGML_KVQ_ENC_TAG + 1) * 4 <= GGML_MAX_OP_PARAMS, "op_params too small");
GGML_API void ggml_kvq_set_encoder(struct ggml_tensor * node, int encoder);
GGML_API int  ggml_kvq_get_encoder(const struct ggml_tensor * node);
// (the CPU: ggml_kvq_cpu_encoder_from_float, ggml-kvq-cpu.h)

// Row validation for ggml_validate_row_data (the type registration seam): d (and ov) finite, oi < 64.
GGML_API bool ggml_kvq_validate_row_nuq(enum ggml_type type, const void * data, size_t nbytes);

// f16 <-> f32 by integer arithmetic only (round to nearest even; NaN keeps sign and
// payload, quieted), so every compiler and flag set gives the same bits.
GGML_KVQ_HD uint16_t ggml_kvq_fp32_to_fp16(float f) {
    union { float f; uint32_t u; } v = { f };
    const uint32_t sign = (v.u >> 16) & 0x8000u;
    const uint32_t ax   = v.u & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) {                     // NaN
        return (uint16_t) (sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    }
    if (ax >= 0x477FF000u) {                    // >= 65520 rounds to inf
        return (uint16_t) (sign | 0x7C00u);
    }
    if (ax >= 0x38800000u) {                    // normal f16 (>= 2^-14)
        const uint32_t m   = ax - 0x38000000u;  // rebias the exponent (127 -> 15)
        const uint32_t r   = m >> 13;
        const uint32_t rem = m & 0x1FFFu;
        return (uint16_t) (sign | (r + (rem > 0x1000u || (rem == 0x1000u && (r & 1)))));
    }
    if (ax < 0x33000000u) {                     // < 2^-25 (or the tie at it) rounds to 0
        return (uint16_t) sign;
    }
    const uint32_t e    = ax >> 23;             // 102..112: f16 subnormal (units of 2^-24)
    const uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
    const uint32_t sh   = 126 - e;
    const uint32_t r    = mant >> sh;
    const uint32_t rem  = mant & ((1u << sh) - 1);
    const uint32_t half = 1u << (sh - 1);
    return (uint16_t) (sign | (r + (rem > half || (rem == half && (r & 1)))));
}

GGML_KVQ_HD float ggml_kvq_fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000u) << 16;
    const uint32_t e    = (h >> 10) & 0x1Fu;
    uint32_t       m    = h & 0x3FFu;
    uint32_t       u;
    if (e == 0x1F) {
        u = sign | 0x7F800000u | (m << 13);
    } else if (e != 0) {
        u = sign | ((e + 112) << 23) | (m << 13);
    } else if (m == 0) {
        u = sign;
    } else {                                    // subnormal: normalise
        int s = 0;
        while (!(m & 0x400u)) { m <<= 1; ++s; }
        u = sign | ((uint32_t) (113 - s) << 23) | ((m & 0x3FFu) << 13);
    }
    union { uint32_t u; float f; } v = { u };
    return v.f;
}

static inline float ggml_kvq_f16_bytes(const uint8_t * p) {
    return ggml_kvq_fp16_to_fp32((uint16_t) (p[0] | (p[1] << 8)));
}

// a trellis run's one-byte scale code (block_tcq*_64, the halves of q4t2_64 / t32_64): 2^((c - 159)/8) for c = 1..255,
// built from the float bits of 2^(i/8) and an exponent step, so every target reads the same float; 0 for c = 0
#define GGML_KVQ_TCQ_SCALE_BIAS 159
GGML_KVQ_HD float ggml_kvq_tcq_scale(uint8_t c) {
    const uint32_t m[8] = { 0x3f800000u, 0x3f8b95c2u, 0x3f9837f0u, 0x3fa5fed7u, 0x3fb504f3u, 0x3fc5672au, 0x3fd744fdu, 0x3feac0c7u };
    const int e = (int) c - GGML_KVQ_TCQ_SCALE_BIAS;
    union { uint32_t u; float f; } v = { m[e & 7] + (uint32_t) ((e >> 3) * (1 << 23)) };
    return c == 0 ? 0.0f : v.f;
}

// a TCQ block's scale at d: its code (sb = 1) or f16 (sb = 2, tcq*_128), sb from ggml_kvq_tcq_scale_bytes
static inline float ggml_kvq_tcq_scale_read(const uint8_t * d, int sb) {
    return sb == 1 ? ggml_kvq_tcq_scale(d[0]) : ggml_kvq_f16_bytes(d);
}

// Entries for ggml.c's type_traits table (the type registration seam), one per row of ggml-kvq-types.h.
#define GGML_KVQ_TRAITS_ROW(name, NAME, id, qk, ...)                            \
    [GGML_TYPE_##NAME] = {                                                      \
        .type_name      = #name,                                                \
        .blck_size      = qk,                                                   \
        .type_size      = sizeof(block_##name),                                 \
        .is_quantized   = true,                                                 \
        .to_float       = (ggml_to_float_t) dequantize_row_##name,              \
        .from_float_ref = (ggml_from_float_t) quantize_row_##name##_ref,        \
    },
#define GGML_KVQ_TYPE_TRAITS GGML_KVQ_TYPES(GGML_KVQ_TRAITS_ROW, 0)

// rows of blocks of block_size bytes that each start with n_scales f16 scales: the size divides and every scale is
// finite (the q53 and tcq families' row checks, native/ggml/kvq-validate.c)
GGML_API bool ggml_kvq_validate_f16_scales(const void * data, size_t nbytes, size_t block_size, int n_scales);
// whether a row of data holds valid blocks of type (ggml_validate_row_data for pykvq's types, by family)
GGML_API bool ggml_kvq_validate_row(enum ggml_type type, const void * data, size_t nbytes);

#ifdef __cplusplus
}
#endif
