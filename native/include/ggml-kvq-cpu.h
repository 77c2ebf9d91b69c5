// pykvq: CPU kernels for the KV-cache types (compiled into ggml-cpu with its
// arch flags; bodies in native/ggml/cpu/). Wired into ggml-cpu.c's type_traits_cpu
// table and the flash-attention V path by the CPU dispatch seam.
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

// nuq*: from_float quantizes with the bound slot-A codebook, bit for bit the reference
void quantize_row_nuq4 (const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_nuq3 (const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_nuq2 (const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_nuq3o(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_nuq2o(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_nuq3_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_nuq2_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);

// K·Q with Q in q8_0: codebook lookup by byte shuffle, int32 sum per 32 values (slot A)
void ggml_vec_dot_nuq4_q8_0 (int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_nuq3_q8_0 (int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_nuq2_q8_0 (int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_nuq3o_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_nuq2o_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_nuq3_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_vec_dot_nuq2_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);

// q53_64 (cpu/q53-cpu.c): the reference quantizer; K·Q with Q in q8_0, one int32 sum per half
void quantize_row_q53_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void dequantize_row_q53_64_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k); // = the reference, SIMD
void ggml_vec_dot_q53_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
// q42_64 (cpu/q53-cpu.c): the same with 4- and 2-bit halves
void quantize_row_q42_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void dequantize_row_q42_64_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k); // = the reference
void ggml_vec_dot_q42_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
// q32_64 (cpu/q53-cpu.c): the same with 3- and 2-bit halves
void quantize_row_q32_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void dequantize_row_q32_64_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k); // = the reference
void ggml_vec_dot_q32_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);

// tcq3_64 / tcq2_64 (cpu/tcq-cpu.c): the reference's bytes and values by an AVX2 path search and read-back; K·Q with
// Q in q8_0 through the read-back values
void quantize_row_tcq3_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void dequantize_row_tcq3_64_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k); // = the reference
void ggml_vec_dot_tcq3_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void quantize_row_tcq2_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void dequantize_row_tcq2_64_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k); // = the reference
void ggml_vec_dot_tcq2_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
// tcq25_64 (cpu/tcq-cpu.c): the same path search with 3- and 2-bit steps by turns, its read-back with both parities' tables
void quantize_row_tcq25_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void dequantize_row_tcq25_64_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k); // = the reference
void ggml_vec_dot_tcq25_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
// tcq35_64 (cpu/tcq-cpu.c): 4- and 3-bit steps by turns
void quantize_row_tcq35_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void dequantize_row_tcq35_64_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k); // = the reference
void ggml_vec_dot_tcq35_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
// tcq3_128 / tcq2_128 (cpu/tcq-cpu.c): two runs of 64 under one scale, the same kernels per run
void quantize_row_tcq3_128(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void dequantize_row_tcq3_128_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k); // = the reference
void ggml_vec_dot_tcq3_128_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void quantize_row_tcq2_128(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void dequantize_row_tcq2_128_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k); // = the reference
void ggml_vec_dot_tcq2_128_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
// q4t2_64 (cpu/tcq-cpu.c, beside the path search it shares): q42_64's first half, a 32-value tcq2 block second
void quantize_row_q4t2_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void dequantize_row_q4t2_64_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k); // = the reference
void ggml_vec_dot_q4t2_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
// t32_64 (cpu/tcq-cpu.c): a 32-value tcq3 block, then a tcq2 one
void quantize_row_t32_64(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void dequantize_row_t32_64_cpu(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k); // = the reference
void ggml_vec_dot_t32_64_q8_0(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx, size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);

// least-squares block scales (cpu/lsq-cpu.c; the rule: native/ggml/lsq.c): the same bits, the candidate scales side by side
void ggml_kvq_cpu_lsq_block(const float * x, int half, uint8_t d_out[2], uint8_t * q);
void quantize_row_q4_0_lsq_cpu(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void quantize_row_q5_0_lsq_cpu(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
// the from_float a SET_ROWS into dst takes instead of the type's own where the node asks for least-squares
// scales (ggml_kvq_set_encoder) and dst is q4_0 / q5_0; NULL otherwise (the CPU dispatch seam, ops.cpp)
GGML_BACKEND_API ggml_from_float_t ggml_kvq_cpu_encoder_from_float(const struct ggml_tensor * dst);

// Codebooks for the node about to run (called first thing in ggml_compute_forward, by
// every thread): when the node or one of src[0..2] is a nuq type, its op_params slots go
// to this thread's storage in ggml-cpu and in ggml-base (ggml_kvq_bind_codebooks), which
// the kernels and the base trait functions read; otherwise whatever was bound is dropped.
// NULL unbinds (the end of a graph).
GGML_BACKEND_API void ggml_kvq_cpu_bind(const struct ggml_tensor * node);
// Bind codebooks directly (the tests; NULL = not present, i.e. the fallback).
GGML_BACKEND_API void ggml_kvq_cpu_bind_codebooks(const int8_t * cb_a, const int8_t * cb_b);

// SIMD dequantizer for a pykvq type (V expansion in flash attention);
// NULL for other types, which keep ggml's to_float.
ggml_to_float_t ggml_kvq_cpu_to_float(enum ggml_type type);
// The same for K rows (nuq: the slot-A codebook), for flash attention's K tiles.
ggml_to_float_t ggml_kvq_cpu_to_float_k(enum ggml_type type);

// Flash attention for the caches upstream's fast CPU paths leave to the per-row
// loop (every quantized type, mixed K/V types): native/ggml/cpu/fattn.cpp, the CPU dispatch seam.
// _supported is false for f16/f32 K and V of one type (upstream's tiled and
// split-KV paths), for inputs it does not take, and for every node in mode "0" (the
// per-row path, for comparisons: ggml_kvq_cpu_set_fa_mode); with use_ref
// (the CPU backend as test-backend-ops' reference) for every node but a pre-RoPE K
// cache's, which only ggml_kvq_fattn reads.
struct ggml_compute_params;
bool   ggml_kvq_fattn_supported(const struct ggml_tensor * dst, bool use_ref);
size_t ggml_kvq_fattn_work_size(const struct ggml_tensor * dst, int n_threads);
void   ggml_kvq_fattn(const struct ggml_compute_params * params, struct ggml_tensor * dst);
// Which path quantized caches take: "1" this one (default), "0" upstream's per-row loop, "match" this one with Q
// rounded through K's vec_dot type as the per-row loop does, "all" this one for f16/f32 caches too (the
// equivalence tests). GGML_KVQ_FA, read once at the first node, sets it for a process; false for another name.
GGML_BACKEND_API bool         ggml_kvq_cpu_set_fa_mode(const char * mode);
GGML_BACKEND_API const char * ggml_kvq_cpu_fa_mode(void);

// Every compiled kernel variant ("generic", "avx2", "avx512", "neon", ...), so
// the tests can hold each one against the reference. The last one is in use.
GGML_BACKEND_API int             ggml_kvq_cpu_n_impls(void);
GGML_BACKEND_API const char *    ggml_kvq_cpu_impl_name(int i);
GGML_BACKEND_API ggml_vec_dot_t  ggml_kvq_cpu_impl_vec_dot(int i, enum ggml_type type);
GGML_BACKEND_API ggml_to_float_t ggml_kvq_cpu_impl_to_float(int i, enum ggml_type type);
GGML_BACKEND_API ggml_from_float_t ggml_kvq_cpu_impl_from_float(int i, enum ggml_type type);

// each family's variant table (cpu/bfp-cpu.c, cpu/nuq-cpu.c: the same variants in the same order), which
// cpu/kvq-dispatch.c's entry points above choose from by the type's family
int               ggml_kvq_bfp_cpu_n_impls(void);
const char *      ggml_kvq_bfp_cpu_impl_name(int i);
ggml_from_float_t ggml_kvq_bfp_cpu_impl_from_float(int i, enum ggml_type type);
ggml_vec_dot_t    ggml_kvq_bfp_cpu_impl_vec_dot(int i, enum ggml_type type);
ggml_to_float_t   ggml_kvq_bfp_cpu_impl_to_float(int i, enum ggml_type type);
int               ggml_kvq_nuq_cpu_n_impls(void);
const char *      ggml_kvq_nuq_cpu_impl_name(int i);
ggml_from_float_t ggml_kvq_nuq_cpu_impl_from_float(int i, enum ggml_type type);
ggml_vec_dot_t    ggml_kvq_nuq_cpu_impl_vec_dot(int i, enum ggml_type type);
ggml_to_float_t   ggml_kvq_nuq_cpu_impl_to_float(int i, enum ggml_type type);
ggml_to_float_t   ggml_kvq_nuq_cpu_impl_to_float_k(int i, enum ggml_type type);

// Entries for ggml-cpu.c's type_traits_cpu table (the CPU dispatch seam), one per row of ggml-kvq-types.h.
#define GGML_KVQ_TRAITS_CPU_ROW(name, NAME, id, qk, family, vdt, VDT, ...)     \
    [GGML_TYPE_##NAME] = {                                                      \
        .from_float   = quantize_row_##name,                                    \
        .vec_dot      = ggml_vec_dot_##name##_##vdt,                            \
        .vec_dot_type = GGML_TYPE_##VDT,                                        \
        .nrows        = 1,                                                      \
    },
#define GGML_KVQ_TYPE_TRAITS_CPU GGML_KVQ_TYPES(GGML_KVQ_TRAITS_CPU_ROW, 0)

#ifdef __cplusplus
}
#endif
