// pykvq: KV-cache quantization types and hooks for ggml / llama.cpp.
//
// Everything pykvq adds to ggml is declared here; the bodies live next to this
// header in native/, and native/patches/ wires them into the pinned tree.
#pragma once

#include "ggml.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
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
//   amax is inf     -> s = 127 (mantissas saturate)
//   otherwise       -> frexp(amax) = f * 2^E, f in [0.5, 1)
//                      s = E - (b-1) + (f >= (M + 0.5) / 2^(b-1))
//                      i.e. the smallest s with rint(amax / 2^s) <= M
//   s clamped to [-127, 127], stored as e = s + 127 (E8M0, like MXFP4)
//   m = clamp(rint(x * 2^-s), -M, M)   (round half to even; NaN -> 0)
//   x' = m * 2^(e - 127)
// with b the mantissa bits and M = 2^(b-1) - 1 (7 for bfp4, 127 for bfp8).
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
static inline float ggml_kvq_e8m0_to_fp32(uint8_t e) {
    union { uint32_t u; float f; } v;
    v.u = e == 0 ? 0x00400000u : (uint32_t) e << 23;
    return v.f;
}

// Entries for ggml.c's type_traits table (patch 0002).
#define GGML_KVQ_TYPE_TRAITS                                                    \
    [GGML_TYPE_BFP4_32] = {                                                     \
        .type_name      = "bfp4_32",                                            \
        .blck_size      = QK_BFP32,                                             \
        .type_size      = sizeof(block_bfp4_32),                                \
        .is_quantized   = true,                                                 \
        .to_float       = (ggml_to_float_t) dequantize_row_bfp4_32,             \
        .from_float_ref = (ggml_from_float_t) quantize_row_bfp4_32_ref,         \
    },                                                                          \
    [GGML_TYPE_BFP4_64] = {                                                     \
        .type_name      = "bfp4_64",                                            \
        .blck_size      = QK_BFP64,                                             \
        .type_size      = sizeof(block_bfp4_64),                                \
        .is_quantized   = true,                                                 \
        .to_float       = (ggml_to_float_t) dequantize_row_bfp4_64,             \
        .from_float_ref = (ggml_from_float_t) quantize_row_bfp4_64_ref,         \
    },                                                                          \
    [GGML_TYPE_BFP8_32] = {                                                     \
        .type_name      = "bfp8_32",                                            \
        .blck_size      = QK_BFP32,                                             \
        .type_size      = sizeof(block_bfp8_32),                                \
        .is_quantized   = true,                                                 \
        .to_float       = (ggml_to_float_t) dequantize_row_bfp8_32,             \
        .from_float_ref = (ggml_from_float_t) quantize_row_bfp8_32_ref,         \
    },

#ifdef __cplusplus
}
#endif
