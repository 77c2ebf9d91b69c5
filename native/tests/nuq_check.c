// Standalone check of every compiled nuq kernel variant against the generic one
// and the reference. Built by tests/test_nuq.py with several -march settings (and
// an aarch64 cross compiler run under qemu when present), so SIMD paths this
// machine would not select are still held to the scalar code; the reference
// itself is held to the numpy one from Python.
//
//   quantize (from_float): bytes equal to quantize_row_<type>_ref_cb, every variant
//   to_float:              bits equal to the generic variant, and finite on every input
//   vec_dot (Q in q8_0):   within 1e-5 of the sum of |terms| of the generic variant
// each with the fallback codebook and with random valid codebooks.
#include "ggml-kvq-cpu.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "abort_stub.h"
#include "check_rows.h"

static void random_codebook(int n, int8_t * cb) {
    for (;;) {
        for (int j = 0; j < n; ++j) { cb[j] = (int8_t) ((int) (urand() % 255) - 127); }
        for (int a = 1; a < n; ++a) {           // insertion sort
            for (int b = a; b > 0 && cb[b] < cb[b - 1]; --b) { const int8_t t = cb[b]; cb[b] = cb[b - 1]; cb[b - 1] = t; }
        }
        if (ggml_kvq_nuq_codebook_ok(cb, n)) {
            return;
        }
    }
}

typedef void (*quant_ref_t)(const float *, void *, int64_t, const int8_t *);

enum { NMAX = 320, ROWS = 48 };

// row r of the test data: cache-like rows over a wide scale range, then edge cases
static void make_row(int r, int n, const int8_t * cb, int nc, float * x) {
    const float scale = ldexpf(1.0f, (r % 40) - 20);
    for (int j = 0; j < n; ++j) { x[j] = scale * frand(); }
    switch (r % 16) {
        case 1: memset(x, 0, sizeof(float) * n); break;                      // all zero
        case 2: x[3] = NAN; x[n - 1] = NAN; x[0] = NAN; break;               // NaN
        case 3: x[5] = INFINITY; break;                                      // inf
        case 4: for (int j = 0; j < n; ++j) { x[j] = 1.5f; } break;           // all equal
        case 5: x[0] = 3e38f; x[n / 2] = -3e38f; break;                      // huge
        case 6:                                                              // ties exactly on midpoints
            for (int j = 0; j < n; ++j) {
                if (j % 32 == 0) { x[j] = 127.0f; continue; }                // amax 127: d = 1, id = 1
                const int m = (int) (urand() % (unsigned) (nc - 1));
                x[j] = ((float) cb[m] + (float) cb[m + 1]) * 0.5f;
            }
            break;
        case 7: for (int j = 0; j < n; j += 64) { x[j] = 50.0f * scale; } break;       // outlier at 0
        case 8: for (int j = 63; j < n; j += 64) { x[j] = -50.0f * scale; } break;     // outlier at 63
        case 9: x[0] = NAN; for (int j = 1; j < n; ++j) { x[j] = 0.0f; } break;         // NaN alone
        case 10: for (int j = 0; j < n; ++j) { x[j] = 1e-39f * (float) (j % 7); } break; // subnormal scale
        // edge inputs (docs/FORMATS.md): beyond f16 range, inf next to huge finite values,
        // f32 subnormals, scales in f16's subnormal range, all NaN
        case 11: for (int j = 0; j < n; ++j) { x[j] = 1e9f * frand(); } break;
        case 12: x[0] = INFINITY; x[1] = 65519.0f; x[n / 2] = -3.4e38f; x[n - 1] = -INFINITY; x[n - 2] = 70000.0f; break;
        case 13: for (int j = 0; j < n; ++j) { x[j] = 1e-40f * frand(); } break;
        case 14: for (int j = 0; j < n; ++j) { x[j] = 3e-6f * frand(); } break;
        case 15: for (int j = 0; j < n; ++j) { x[j] = (j % 5) ? NAN : -NAN; } break;
        default: break;
    }
}

// block size and bytes of any pykvq type, from the type table
#define KVQ_SIZE_CASE(name, NAME, id, qk_, ...) case GGML_TYPE_##NAME: *qk = qk_; return sizeof(block_##name);
static size_t kvq_type_size(enum ggml_type t, int * qk) {
    switch (t) {
        GGML_KVQ_TYPES(KVQ_SIZE_CASE, 0)
        default: *qk = 1; return 0;
    }
}

// `nuq_check IN OUT`: run every compiled variant's from_float and to_float (bfp and nuq types) on
// the rows in IN and write what they give to OUT, for tests/test_numerics.py to hold to numpy
// (this is how its property tests reach NEON under qemu). IN: records of int32 type, int32 n,
// int32 has_cb, int8 cb[16], float x[n]. OUT: int32 n_impls, then per record and variant the
// quantized bytes and the n dequantized floats.
static int dump(const char * in_path, const char * out_path) {
    FILE * in  = fopen(in_path, "rb");
    FILE * out = fopen(out_path, "wb");
    if (!in || !out) {
        return 2;
    }
    const int32_t ni = ggml_kvq_cpu_n_impls();
    fwrite(&ni, 4, 1, out);
    int32_t hdr[3];
    int8_t  cb[16];
    while (fread(hdr, 4, 3, in) == 3 && fread(cb, 1, 16, in) == 16) {
        const enum ggml_type t = (enum ggml_type) hdr[0];
        const int n = hdr[1];
        int qk;
        const size_t bs = kvq_type_size(t, &qk);
        float   * x = malloc(sizeof(float) * n);
        float   * y = malloc(sizeof(float) * n);
        uint8_t * q = malloc((size_t) (n / qk) * bs);
        if (fread(x, sizeof(float), (size_t) n, in) != (size_t) n) {
            return 3;
        }
        ggml_kvq_cpu_bind_codebooks(hdr[2] ? cb : NULL, hdr[2] ? cb : NULL);
        for (int i = 0; i < ni; ++i) {
            ggml_kvq_cpu_impl_from_float(i, t)(x, q, n);
            ggml_kvq_cpu_impl_to_float(i, t)(q, y, n);
            fwrite(q, 1, (size_t) (n / qk) * bs, out);
            fwrite(y, sizeof(float), (size_t) n, out);
        }
        ggml_kvq_cpu_bind_codebooks(NULL, NULL);
        free(x); free(y); free(q);
    }
    fclose(in);
    return fclose(out) != 0;
}

int main(int argc, char ** argv) {
    if (argc == 3) {
        return dump(argv[1], argv[2]);
    }
    enum { NT = 7 };
    const enum ggml_type types[NT] = { GGML_TYPE_NUQ4, GGML_TYPE_NUQ3, GGML_TYPE_NUQ2, GGML_TYPE_NUQ3O, GGML_TYPE_NUQ2O,
                                       GGML_TYPE_NUQ3_64, GGML_TYPE_NUQ2_64 };
    const char * names[NT] = { "nuq4", "nuq3", "nuq2", "nuq3o", "nuq2o", "nuq3_64", "nuq2_64" };
    const quant_ref_t ref[NT] = { quantize_row_nuq4_ref_cb, quantize_row_nuq3_ref_cb, quantize_row_nuq2_ref_cb,
                                  quantize_row_nuq3o_ref_cb, quantize_row_nuq2o_ref_cb, quantize_row_nuq3_64_ref_cb,
                                  quantize_row_nuq2_64_ref_cb };
    const int lens[3] = { 96, 256, 320 };
    static float x[NMAX], q[NMAX], y0[NMAX], y1[NMAX];
    static uint8_t k0[NMAX * 2], k1[NMAX * 2];
    static q8_block qy[NMAX / 32];
    int bad = 0;

    if (ggml_kvq_nuq_cpu_n_impls() != ggml_kvq_cpu_n_impls()) {
        printf("FAIL nuq has %d variants, bfp %d\n", ggml_kvq_nuq_cpu_n_impls(), ggml_kvq_cpu_n_impls());
        return 1;
    }
    for (int i = 0; i < ggml_kvq_cpu_n_impls(); ++i) {
        if (strcmp(ggml_kvq_nuq_cpu_impl_name(i), ggml_kvq_cpu_impl_name(i)) != 0) {
            printf("FAIL variant %d: nuq %s, bfp %s\n", i, ggml_kvq_nuq_cpu_impl_name(i), ggml_kvq_cpu_impl_name(i));
            return 1;
        }
    }

    for (int i = 0; i < ggml_kvq_cpu_n_impls(); ++i) {
        double worst = 0.0;
        int    fails = 0;
        for (int t = 0; t < NT; ++t) {
            const int nc = ggml_kvq_nuq_n_codes(types[t]);
            const int qk = ggml_kvq_nuq_block(types[t]);
            for (int c = 0; c < 4; ++c) {
                int8_t cb[16] = {0};
                const int8_t * use = NULL;                 // c == 0: the fallback
                if (c > 0) { random_codebook(nc, cb); use = cb; }
                else       { memcpy(cb, ggml_kvq_nuq_fallback(types[t]), (size_t) nc); }
                ggml_kvq_cpu_bind_codebooks(use, use);
                for (int li = 0; li < 3; ++li) {
                    const int n = lens[li];
                    if (n % qk) { continue; }
                    for (int r = 0; r < ROWS; ++r) {
                        make_row(r, n, cb, nc, x);
                        for (int j = 0; j < n; ++j) { q[j] = frand(); }

                        ref[t](x, k0, n, use);
                        ggml_kvq_cpu_impl_from_float(i, types[t])(x, k1, n);
                        if (memcmp(k0, k1, (size_t) (n / qk) * ggml_kvq_nuq_type_size(types[t])) != 0) {
                            if (fails++ < 10) printf("FAIL %s %s quantize cb %d n %d row %d\n", ggml_kvq_cpu_impl_name(i), names[t], c, n, r);
                            bad = 1;
                        }

                        ggml_kvq_cpu_impl_to_float(0, types[t])(k0, y0, n);
                        ggml_kvq_cpu_impl_to_float(i, types[t])(k0, y1, n);
                        for (int j = 0; j < n; ++j) {   // no quantized block decodes to inf / NaN
                            if (!isfinite(y0[j])) {
                                if (fails++ < 10) printf("FAIL %s %s decodes %g at %d (cb %d n %d row %d)\n", ggml_kvq_cpu_impl_name(i), names[t], y0[j], j, c, n, r);
                                bad = 1;
                                break;
                            }
                        }
                        if (memcmp(y0, y1, sizeof(float) * n) != 0) {
                            if (fails++ < 10) printf("FAIL %s %s to_float cb %d n %d row %d\n", ggml_kvq_cpu_impl_name(i), names[t], c, n, r);
                            bad = 1;
                        }

                        quantize_q8_0(q, qy, n);
                        float s0, s1;
                        ggml_kvq_cpu_impl_vec_dot(0, types[t])(n, &s0, 0, k0, 0, qy, 0, 1);
                        ggml_kvq_cpu_impl_vec_dot(i, types[t])(n, &s1, 0, k0, 0, qy, 0, 1);
                        double mag = 0.0;  // tolerance relative to the sum of |terms|
                        for (int j = 0; j < n; ++j) {
                            mag += fabs((double) y0[j] * qy[j / 32].qs[j % 32] * ggml_kvq_fp16_to_fp32(qy[j / 32].d));
                        }
                        const double err = fabs((double) s0 - s1) / (mag > 0 ? mag : 1.0);
                        worst = err > worst ? err : worst;
                        if (!(err <= 1e-5)) {
                            if (fails++ < 10) printf("FAIL %s %s vec_dot cb %d n %d row %d: %.9g vs %.9g\n", ggml_kvq_cpu_impl_name(i), names[t], c, n, r, s1, s0);
                            bad = 1;
                        }
                    }
                }
            }
        }
        ggml_kvq_cpu_bind_codebooks(NULL, NULL);
        printf("impl %s ok=%d worst_rel_err=%.3g\n", ggml_kvq_cpu_impl_name(i), fails == 0, worst);
    }
    printf("impls %d\n", ggml_kvq_cpu_n_impls());
    return bad;
}
