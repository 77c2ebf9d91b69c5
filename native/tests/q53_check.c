// Standalone check of the q53_64 CPU kernels (cpu/q53.c) in whatever variant this build compiles: AVX2, or
// the scalar code that a pre-AVX2 x86 or an ARM build runs (q53_64 has no NEON path). Built by
// tests/test_q53.py with several -march settings (aarch64 under qemu), against the reference (native/ggml/q53.c,
// itself held to numpy by test_q53.py):
//   quantize (the SIMD scale search): bytes equal to quantize_row_q53_64_ref
//   to_float:                         bits equal to dequantize_row_q53_64
//   vec_dot (Q in q8_0):              within 1e-5 of the sum of |terms| of the exact integer dot product
#include "ggml-kvq-cpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "abort_stub.h"
#include "check_rows.h"

enum { N = 256, NB = N / QK_Q53, ROWS = 400 };

int main(void) {
    int fails = 0;
    float x[N], xq[N], y_ref[N], y_cpu[N];
    block_q53_64 ref[NB], cpu[NB];
    q8_block q8[N / 32];
    for (int r = 0; r < ROWS; ++r) {
        const float scale = r % 7 == 0 ? 1e-3f : r % 11 == 0 ? 3e4f : 1.0f;
        for (int i = 0; i < N; ++i) {
            x[i] = scale * frand();
            xq[i] = frand();
        }
        if (r % 13 == 0) { for (int i = 0; i < 64; ++i) { x[i] = 0.0f; } }   // an all-zero block
        if (r % 17 == 0) { for (int i = 64; i < 96; ++i) { x[i] = 2.5f; } }   // a constant half
        quantize_row_q53_64_ref(x, ref, N);
        quantize_row_q53_64(x, cpu, N);
        if (memcmp(ref, cpu, sizeof(ref)) != 0) {
            printf("FAIL quantize row %d: bytes differ from the reference\n", r);
            ++fails;
        }
        dequantize_row_q53_64(ref, y_ref, N);
        dequantize_row_q53_64_cpu(ref, y_cpu, N);
        if (memcmp(y_ref, y_cpu, sizeof(y_ref)) != 0) {
            printf("FAIL to_float row %d: bits differ from the reference\n", r);
            ++fails;
        }
        // the exact dot product: dequantized K (exact in float) times Q's int8 values and scales, in double
        quantize_q8_0(xq, q8, N);
        double exact = 0.0, mag = 0.0;
        for (int i = 0; i < N; ++i) {
            const double t = (double) y_ref[i] * ggml_kvq_fp16_to_fp32(q8[i / 32].d) * q8[i / 32].qs[i % 32];
            exact += t;
            mag   += fabs(t);
        }
        float s = 0.0f;
        ggml_vec_dot_q53_64_q8_0(N, &s, 0, ref, 0, q8, 0, 1);
        if (!(fabs(s - exact) <= 1e-5 * mag + 1e-30)) {
            printf("FAIL vec_dot row %d: %.9g vs exact %.9g (sum |terms| %.3g)\n", r, s, exact, mag);
            ++fails;
        }
    }
#if defined(__AVX2__)
    const char * variant = "avx2";
#else
    const char * variant = "scalar";
#endif
    printf("q53_64 %s: %d rows, %d failures; impls 1\n", variant, ROWS, fails);
    return fails != 0;
}
