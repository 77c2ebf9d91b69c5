// Standalone check of every compiled bfp kernel variant against the generic one.
// Built by tests/test_bfp.py with several -march settings (and an aarch64 cross
// compiler run under qemu when present), so SIMD paths this machine would not
// select are still held to the scalar code; the scalar code itself is held to
// the numpy reference from Python.
#include "ggml-kvq-cpu.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "abort_stub.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static float frand(void) {  // roughly normal, with occasional outliers
    float s = 0.0f;
    for (int i = 0; i < 4; ++i) {
        rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
        s += (float) ((rng_state >> 40) & 0xFFFFFF) / 16777216.0f - 0.5f;
    }
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return ((rng_state >> 33) % 97 == 0) ? 40.0f * s : s;
}

typedef void (*quant_ref_t)(const float *, void *, int64_t);

int main(void) {
    enum { N = 256, ROWS = 64 };
    const char * names[3] = { "bfp4_32", "bfp4_64", "bfp8_32" };
    const enum ggml_type types[3] = { GGML_TYPE_BFP4_32, GGML_TYPE_BFP4_64, GGML_TYPE_BFP8_32 };
    const quant_ref_t quant[3] = { (quant_ref_t) quantize_row_bfp4_32_ref, (quant_ref_t) quantize_row_bfp4_64_ref,
                                   (quant_ref_t) quantize_row_bfp8_32_ref };
    static float x[N], q[N], y0[N], y1[N];
    static uint8_t kx[N * 2], qy[N * 2];
    int bad = 0;

    for (int i = 1; i < ggml_kvq_cpu_n_impls(); ++i) {
        double worst = 0.0;
        for (int t = 0; t < 3; ++t) {
            for (int r = 0; r < ROWS; ++r) {
                const float scale = ldexpf(1.0f, (r % 40) - 20);
                for (int j = 0; j < N; ++j) { x[j] = scale * frand(); q[j] = frand(); }
                switch (r % 8) {   // edge inputs (docs/FORMATS.md): the decoded rows stay finite
                    case 1: x[3] = INFINITY; x[70] = -INFINITY; x[200] = NAN; break;
                    case 2:   // near FLT_MAX (Q small, so K·Q stays finite)
                        for (int j = 0; j < N; ++j) { x[j] = 3.4e38f * frand(); q[j] *= 1e-20f; }
                        x[0] = 3.4028235e38f;
                        break;
                    case 3: for (int j = 0; j < N; ++j) { x[j] = 1e-40f * frand(); } break;
                    case 4: memset(x, 0, sizeof(x)); x[100] = NAN; break;
                    default: break;
                }
                quant[t](x, kx, N);
                quantize_row_bfp8_32_ref(q, (block_bfp8_32 *) qy, N);

                float s0, s1;
                ggml_kvq_cpu_impl_vec_dot(0, types[t])(N, &s0, 0, kx, 0, qy, 0, 1);
                ggml_kvq_cpu_impl_vec_dot(i, types[t])(N, &s1, 0, kx, 0, qy, 0, 1);
                ggml_kvq_cpu_impl_to_float(0, types[t])(kx, y0, N);
                ggml_kvq_cpu_impl_to_float(i, types[t])(kx, y1, N);

                double mag = 0.0;  // tolerance relative to the sum of |terms|
                for (int j = 0; j < N; ++j) { mag += fabs((double) y0[j] * q[j]); }
                const double err = fabs((double) s0 - s1) / (mag > 0 ? mag : 1.0);
                worst = err > worst ? err : worst;
                if (err > 1e-5) {
                    printf("FAIL %s %s vec_dot row %d: %g vs %g\n", ggml_kvq_cpu_impl_name(i), names[t], r, s1, s0);
                    bad = 1;
                }
                for (int j = 0; j < N; ++j) {
                    if (!isfinite(y0[j])) {
                        printf("FAIL %s row %d decodes %g at %d\n", names[t], r, y0[j], j);
                        bad = 1;
                        break;
                    }
                }
                if (memcmp(y0, y1, sizeof(y0)) != 0) {
                    printf("FAIL %s %s to_float row %d differs\n", ggml_kvq_cpu_impl_name(i), names[t], r);
                    bad = 1;
                }
            }
        }
        printf("impl %s ok=%d worst_rel_err=%.3g\n", ggml_kvq_cpu_impl_name(i), !bad, worst);
    }
    printf("impls %d\n", ggml_kvq_cpu_n_impls());
    return bad;
}
