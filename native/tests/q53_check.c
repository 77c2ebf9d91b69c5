// Standalone check of the q53_64, q42_64 and q32_64 CPU kernels (cpu/q53-cpu.c) in whatever variant this build compiles: AVX2,
// aarch64 NEON (with or without the dot-product extension), or the scalar code of a pre-AVX2 x86. Built by
// tests/test_q53.py with several -march settings (aarch64 under qemu), against the reference (native/ggml/q53.c,
// itself held to numpy by test_q53.py):
//   quantize (the SIMD scale search): bytes equal to quantize_row_<type>_ref
//   to_float:                         bits equal to dequantize_row_<type>
//   vec_dot (Q in q8_0):              within 1e-5 of the sum of |terms| of the exact integer dot product
#include "ggml-kvq-cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "abort_stub.h"
#include "check_rows.h"

enum { N = 256, ROWS = 400, MAX_BYTES = N / 64 * 36 };

// one type's entry points, on untyped blocks
typedef struct {
    const char * name;
    size_t       block_bytes;
    void (*quantize_ref)(const float * x, void * y, int64_t k);
    void (*quantize)(const float * x, void * y, int64_t k);
    void (*dequantize_ref)(const void * x, float * y, int64_t k);
    void (*dequantize)(const void * x, float * y, int64_t k);
    void (*vec_dot)(int n, float * s, size_t bs, const void * x, size_t bx, const void * y, size_t by, int nrc);
} q53_kind;

static void q53_qref(const float * x, void * y, int64_t k) { quantize_row_q53_64_ref(x, (block_q53_64 *) y, k); }
static void q53_dref(const void * x, float * y, int64_t k) { dequantize_row_q53_64((const block_q53_64 *) x, y, k); }
static void q42_qref(const float * x, void * y, int64_t k) { quantize_row_q42_64_ref(x, (block_q42_64 *) y, k); }
static void q42_dref(const void * x, float * y, int64_t k) { dequantize_row_q42_64((const block_q42_64 *) x, y, k); }
static void q32_qref(const float * x, void * y, int64_t k) { quantize_row_q32_64_ref(x, (block_q32_64 *) y, k); }
static void q32_dref(const void * x, float * y, int64_t k) { dequantize_row_q32_64((const block_q32_64 *) x, y, k); }

static int check(const q53_kind * t) {
    int fails = 0;
    float x[N], xq[N], y_ref[N], y_cpu[N];
    uint8_t ref[MAX_BYTES], cpu[MAX_BYTES];
    const size_t bytes = N / 64 * t->block_bytes;
    q8_block q8[N / 32];
    for (int r = 0; r < ROWS; ++r) {
        const float scale = r % 7 == 0 ? 1e-3f : r % 11 == 0 ? 3e4f : 1.0f;
        for (int i = 0; i < N; ++i) {
            x[i] = scale * frand();
            xq[i] = frand();
        }
        if (r % 13 == 0) { for (int i = 0; i < 64; ++i) { x[i] = 0.0f; } }   // an all-zero block
        if (r % 17 == 0) { for (int i = 64; i < 96; ++i) { x[i] = 2.5f; } }   // a constant half
        t->quantize_ref(x, ref, N);
        t->quantize(x, cpu, N);
        if (memcmp(ref, cpu, bytes) != 0) {
            printf("FAIL %s quantize row %d: bytes differ from the reference\n", t->name, r);
            ++fails;
        }
        t->dequantize_ref(ref, y_ref, N);
        t->dequantize(ref, y_cpu, N);
        if (memcmp(y_ref, y_cpu, sizeof(y_ref)) != 0) {
            printf("FAIL %s to_float row %d: bits differ from the reference\n", t->name, r);
            ++fails;
        }
        // the exact dot product: dequantized K (exact in float) times Q's int8 values and scales, in double
        quantize_q8_0(xq, q8, N);
        double exact = 0.0, mag = 0.0;
        for (int i = 0; i < N; ++i) {
            const double p = (double) y_ref[i] * ggml_kvq_fp16_to_fp32(q8[i / 32].d) * q8[i / 32].qs[i % 32];
            exact += p;
            mag   += fabs(p);
        }
        float s = 0.0f;
        t->vec_dot(N, &s, 0, ref, 0, q8, 0, 1);
        if (!(fabs(s - exact) <= 1e-5 * mag + 1e-30)) {
            printf("FAIL %s vec_dot row %d: %.9g vs exact %.9g (sum |terms| %.3g)\n", t->name, r, s, exact, mag);
            ++fails;
        }
    }
    return fails;
}

int main(void) {
    static const q53_kind kinds[] = {
        { "q53_64", sizeof(block_q53_64), q53_qref, quantize_row_q53_64, q53_dref, dequantize_row_q53_64_cpu,
          ggml_vec_dot_q53_64_q8_0 },
        { "q42_64", sizeof(block_q42_64), q42_qref, quantize_row_q42_64, q42_dref, dequantize_row_q42_64_cpu,
          ggml_vec_dot_q42_64_q8_0 },
        { "q32_64", sizeof(block_q32_64), q32_qref, quantize_row_q32_64, q32_dref, dequantize_row_q32_64_cpu,
          ggml_vec_dot_q32_64_q8_0 },
    };
#if defined(__AVX2__)
    const char * variant = "avx2";
#elif defined(__ARM_NEON) && defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
    const char * variant = "neon-dotprod";
#elif defined(__ARM_NEON) && defined(__aarch64__)
    const char * variant = "neon";
#else
    const char * variant = "scalar";
#endif
    int fails = 0;
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); ++i) {
        const int f = check(&kinds[i]);
        printf("%s %s: %d rows, %d failures\n", kinds[i].name, variant, ROWS, f);
        fails += f;
    }
    printf("impls 1\n");
    return fails != 0;
}
