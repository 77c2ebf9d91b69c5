// OUT_PROD with a quantized src0: the MUL_MAT backward pass w.r.t. the activations, what a runtime backward pass
// through a quantized model spends its time on (pykvq.gradients: per-token K / V gradients for the converter).
// Upstream dequantizes each src0 row once per dst row, i.e. every weight once per token: SmolLM2 took 38 s a 512-token
// backward pass that way, 9 s with this. Here a row is dequantized once per tile of dst rows and columns, and four
// src0 rows are added per pass over a dst row. Each dst element still sums its terms in upstream's order (i01
// ascending, one multiply-add each), so the result is upstream's.
#include "ggml-kvq-cpu.h"

#include "ggml-cpu-impl.h"
#include "simd-mappings.h"
#include "vec.h"

#define KVQ_OUT_PROD_ROWS 32      // dst rows (tokens) per tile
#define KVQ_OUT_PROD_COLS 1024    // dst columns per tile: a dst tile of 128 KB, four dequantized row pieces of 16 KB

// y += x0*v0; y += x1*v1; y += x2*v2; y += x3*v3, each a multiply-add in that order
static inline void kvq_vec_mad4_f32(const int n, float * GGML_RESTRICT y, const float * GGML_RESTRICT x,
                                    const int64_t xs, const float v[4]) {
    const float * x0 = x, * x1 = x + xs, * x2 = x + 2*xs, * x3 = x + 3*xs;
    int i = 0;
#if defined(GGML_SIMD) && !defined(__ARM_FEATURE_SVE) && !defined(__riscv_v_intrinsic)
    const GGML_F32_VEC a0 = GGML_F32_VEC_SET1(v[0]), a1 = GGML_F32_VEC_SET1(v[1]);
    const GGML_F32_VEC a2 = GGML_F32_VEC_SET1(v[2]), a3 = GGML_F32_VEC_SET1(v[3]);
    for (; i + GGML_F32_EPR <= n; i += GGML_F32_EPR) {
        GGML_F32_VEC s = GGML_F32_VEC_LOAD(y + i);
        s = GGML_F32_VEC_FMA(s, GGML_F32_VEC_LOAD(x0 + i), a0);
        s = GGML_F32_VEC_FMA(s, GGML_F32_VEC_LOAD(x1 + i), a1);
        s = GGML_F32_VEC_FMA(s, GGML_F32_VEC_LOAD(x2 + i), a2);
        s = GGML_F32_VEC_FMA(s, GGML_F32_VEC_LOAD(x3 + i), a3);
        GGML_F32_VEC_STORE(y + i, s);
    }
#endif
    for (; i < n; ++i) {
        y[i] += x0[i]*v[0];
        y[i] += x1[i]*v[1];
        y[i] += x2[i]*v[2];
        y[i] += x3[i]*v[3];
    }
}

void ggml_kvq_out_prod_q_f32(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * src0 = dst->src[0];
    const struct ggml_tensor * src1 = dst->src[1];
    GGML_TENSOR_BINARY_OP_LOCALS

    const ggml_to_float_t to_float = ggml_get_type_traits(src0->type)->to_float;
    const int64_t qk = ggml_blck_size(src0->type);
    const size_t  qs = ggml_type_size(src0->type);
    const int64_t cols = qk >= KVQ_OUT_PROD_COLS ? qk : (KVQ_OUT_PROD_COLS / qk) * qk;
    GGML_ASSERT(cols <= KVQ_OUT_PROD_COLS && ne0 % qk == 0);

    float w[4][KVQ_OUT_PROD_COLS] __attribute__((aligned(64)));

    // dst rows split over the threads as upstream does
    const int64_t nr  = ne1*ne2*ne3;
    const int64_t dr  = (nr + params->nth - 1)/params->nth;
    const int64_t ir0 = dr*params->ith;
    const int64_t ir1 = MIN(ir0 + dr, nr);

    for (int64_t it = ir0; it < ir1; ) {
        const int64_t i3  = it/(ne2*ne1);
        const int64_t i2  = (it - i3*ne2*ne1)/ne1;
        const int64_t i10 = it - i3*ne2*ne1 - i2*ne1;
        const int64_t n_t = MIN(MIN((int64_t) KVQ_OUT_PROD_ROWS, ir1 - it), ne1 - i10);   // a tile shares i2, i3

        for (int64_t c0 = 0; c0 < ne0; c0 += cols) {
            const int64_t nc = MIN(cols, ne0 - c0);
            for (int64_t i01 = 0; i01 < ne01; i01 += 4) {
                const int64_t nu = MIN((int64_t) 4, ne01 - i01);
                for (int64_t u = 0; u < nu; ++u) {
                    to_float((const char *) src0->data + (i01 + u)*nb01 + i2*nb02 + i3*nb03 + (c0/qk)*qs, w[u], nc);
                }
                for (int64_t i1 = i10; i1 < i10 + n_t; ++i1) {
                    const char * s1 = (const char *) src1->data + i1*nb10 + i01*nb11 + i2*nb12 + i3*nb13;
                    float * d = (float *) ((char *) dst->data + i1*nb1 + i2*nb2 + i3*nb3) + c0;
                    if (nu == 4) {
                        const float v[4] = { *(const float *) s1, *(const float *) (s1 + nb11),
                                             *(const float *) (s1 + 2*nb11), *(const float *) (s1 + 3*nb11) };
                        kvq_vec_mad4_f32((int) nc, d, w[0], KVQ_OUT_PROD_COLS, v);
                    } else {
                        for (int64_t u = 0; u < nu; ++u) {
                            ggml_vec_mad_f32((int) nc, d, w[u], *(const float *) (s1 + u*nb11));
                        }
                    }
                }
            }
        }
        it += n_t;
    }
}
