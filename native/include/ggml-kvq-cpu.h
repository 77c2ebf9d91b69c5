// pykvq: CPU kernels for the KV-cache types (compiled into ggml-cpu with its
// arch flags; bodies in native/cpu/). Wired into ggml-cpu.c's type_traits_cpu
// table and the flash-attention V path by patch 0002.
#pragma once

#include "ggml-kvq.h"
#include "ggml-cpu.h"

#ifdef __cplusplus
extern "C" {
#endif

// from_float: quantize a row (the cache write path, SET_ROWS / CPY)
void quantize_row_bfp4_32(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_bfp4_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_bfp8_32(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);

// K·Q with Q in bfp8_32: integer multiply-add per block, one exponent product per block
void ggml_vec_dot_bfp4_32_bfp8_32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_bfp4_64_bfp8_32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_bfp8_32_bfp8_32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);

// SIMD dequantizer for a pykvq type (V expansion in flash attention);
// NULL for other types, which keep ggml's to_float.
ggml_to_float_t ggml_kvq_cpu_to_float(enum ggml_type type);

// Every compiled kernel variant ("generic", "avx2", "avx512", "neon", ...), so
// the tests can hold each one against the reference. The last one is in use.
GGML_BACKEND_API int             ggml_kvq_cpu_n_impls(void);
GGML_BACKEND_API const char *    ggml_kvq_cpu_impl_name(int i);
GGML_BACKEND_API ggml_vec_dot_t  ggml_kvq_cpu_impl_vec_dot(int i, enum ggml_type type);
GGML_BACKEND_API ggml_to_float_t ggml_kvq_cpu_impl_to_float(int i, enum ggml_type type);

// Entries for ggml-cpu.c's type_traits_cpu table (patch 0002).
#define GGML_KVQ_TYPE_TRAITS_CPU                                                \
    [GGML_TYPE_BFP4_32] = {                                                     \
        .from_float   = quantize_row_bfp4_32,                                   \
        .vec_dot      = ggml_vec_dot_bfp4_32_bfp8_32,                           \
        .vec_dot_type = GGML_TYPE_BFP8_32,                                      \
        .nrows        = 1,                                                      \
    },                                                                          \
    [GGML_TYPE_BFP4_64] = {                                                     \
        .from_float   = quantize_row_bfp4_64,                                   \
        .vec_dot      = ggml_vec_dot_bfp4_64_bfp8_32,                           \
        .vec_dot_type = GGML_TYPE_BFP8_32,                                      \
        .nrows        = 1,                                                      \
    },                                                                          \
    [GGML_TYPE_BFP8_32] = {                                                     \
        .from_float   = quantize_row_bfp8_32,                                   \
        .vec_dot      = ggml_vec_dot_bfp8_32_bfp8_32,                           \
        .vec_dot_type = GGML_TYPE_BFP8_32,                                      \
        .nrows        = 1,                                                      \
    },

#ifdef __cplusplus
}
#endif
