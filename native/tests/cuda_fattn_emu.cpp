// The CUDA decode flash-attention kernel (native/cuda/kvq-fattn.cuh), its very source, run on
// the host under cuda_emu/common.cuh's fiber emulation and compared with attention computed in
// double precision over the same dequantized K / V (the C reference dequantizers). Covers the
// GQA grouping (1, 3 and 12 query heads per KV head: one and two head blocks), KV lengths that
// are and are not multiples of the tiles, one and several splits, sequences with a broadcast
// mask, masked keys, ALiBi, softcap and sinks, f16 / q8_0 K with low-bit V, nuq codebooks.
// Built and run by tests/test_cuda.py.
#include "common.cuh"           // the emulator: cuda_emu/ comes first in the include path
#include "kvq-fattn.cuh"

#include <cstdarg>
#include <cstring>
#include <random>

#include "abort_stub.h"

static std::mt19937 rng(1234);

static float gauss() {
    static std::normal_distribution<float> n(0.0f, 1.0f);
    return n(rng);
}

struct Case {
    int   n_kv_heads, gqa, n_kv, n_seq, kv_per_split;
    bool  mask, sinks;
    float softcap, max_bias;
    int   ne33;     // mask sequences (1: broadcast over sequences)
};

// one row of n values in type t (cb: the nuq codebook); returns the dequantized row
static void encode_row(ggml_type t, const float * x, int n, const int8_t * cb, uint8_t * out, float * deq) {
    switch (t) {
        case GGML_TYPE_F16:
            for (int i = 0; i < n; ++i) {
                const uint16_t h = ggml_kvq_fp32_to_fp16(x[i]);
                memcpy(out + 2*i, &h, 2);
                deq[i] = ggml_kvq_fp16_to_fp32(h);
            }
            return;
        case GGML_TYPE_Q8_0:    // d = amax/127 as f16, q = round(x/d): what matters here is valid bytes
            for (int b = 0; b < n/32; ++b) {
                float amax = 0.0f;
                for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[32*b + i]));
                const uint16_t dh = ggml_kvq_fp32_to_fp16(amax/127.0f);
                const float d = ggml_kvq_fp16_to_fp32(dh);
                memcpy(out + 34*b, &dh, 2);
                for (int i = 0; i < 32; ++i) {
                    const int q = d == 0.0f ? 0 : std::max(-127, std::min(127, (int) lrintf(x[32*b + i]/d)));
                    out[34*b + 2 + i] = (uint8_t) (int8_t) q;
                    deq[32*b + i] = d*(float) q;
                }
            }
            return;
        case GGML_TYPE_BFP4_32: quantize_row_bfp4_32_ref(x, (block_bfp4_32 *) out, n); dequantize_row_bfp4_32((const block_bfp4_32 *) out, deq, n); return;
        case GGML_TYPE_BFP4_64: quantize_row_bfp4_64_ref(x, (block_bfp4_64 *) out, n); dequantize_row_bfp4_64((const block_bfp4_64 *) out, deq, n); return;
        case GGML_TYPE_BFP8_32: quantize_row_bfp8_32_ref(x, (block_bfp8_32 *) out, n); dequantize_row_bfp8_32((const block_bfp8_32 *) out, deq, n); return;
        case GGML_TYPE_NUQ4:    quantize_row_nuq4_ref_cb (x, out, n, cb); dequantize_row_nuq4_cb (out, deq, n, cb); return;
        case GGML_TYPE_NUQ3:    quantize_row_nuq3_ref_cb (x, out, n, cb); dequantize_row_nuq3_cb (out, deq, n, cb); return;
        case GGML_TYPE_NUQ2:    quantize_row_nuq2_ref_cb (x, out, n, cb); dequantize_row_nuq2_cb (out, deq, n, cb); return;
        case GGML_TYPE_NUQ3O:   quantize_row_nuq3o_ref_cb(x, out, n, cb); dequantize_row_nuq3o_cb(out, deq, n, cb); return;
        case GGML_TYPE_NUQ2O:   quantize_row_nuq2o_ref_cb(x, out, n, cb); dequantize_row_nuq2o_cb(out, deq, n, cb); return;
        default: abort();
    }
}

static size_t row_bytes(ggml_type t, int n) {
    switch (t) {
        case GGML_TYPE_F16:     return 2*(size_t) n;
        case GGML_TYPE_Q8_0:    return 34*(size_t) (n/32);
        case GGML_TYPE_BFP4_32: return sizeof(block_bfp4_32)*(size_t) (n/QK_BFP32);
        case GGML_TYPE_BFP4_64: return sizeof(block_bfp4_64)*(size_t) (n/QK_BFP64);
        case GGML_TYPE_BFP8_32: return sizeof(block_bfp8_32)*(size_t) (n/QK_BFP32);
        default:                return ggml_kvq_nuq_type_size(t)*(size_t) (n/ggml_kvq_nuq_block(t));
    }
}

static void random_codebook(int8_t * cb, int n) {
    std::vector<int> all(255);
    for (int i = 0; i < 255; ++i) all[i] = i - 127;
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + n);
    for (int i = 0; i < 16; ++i) cb[i] = i < n ? (int8_t) all[i] : 0;
}

static int failures = 0;
static int cases    = 0;

template <int D, ggml_type TK, ggml_type TV>
static void run_case(const char * name, const Case & c) {
    const int n_heads = c.n_kv_heads*c.gqa;
    int8_t cbk[16] = {0}, cbv[16] = {0};
    if (ggml_kvq_is_nuq(TK)) random_codebook(cbk, ggml_kvq_nuq_n_codes(TK));
    if (ggml_kvq_is_nuq(TV)) random_codebook(cbv, ggml_kvq_nuq_n_codes(TV));

    std::vector<float> Q((size_t) D*n_heads*c.n_seq);
    for (float & q : Q) q = gauss();
    const size_t rbk = row_bytes(TK, D), rbv = row_bytes(TV, D);
    const size_t n_rows = (size_t) c.n_kv*c.n_kv_heads*c.n_seq;
    std::vector<uint8_t> K(rbk*n_rows), V(rbv*n_rows);
    std::vector<float> Kd((size_t) D*n_rows), Vd((size_t) D*n_rows), x(D);
    for (size_t r = 0; r < n_rows; ++r) {
        for (int i = 0; i < D; ++i) x[i] = gauss()*(i % 7 == 0 ? 4.0f : 1.0f);
        encode_row(TK, x.data(), D, cbk, &K[r*rbk], &Kd[r*D]);
        for (int i = 0; i < D; ++i) x[i] = gauss();
        encode_row(TV, x.data(), D, cbv, &V[r*rbv], &Vd[r*D]);
    }
    // mask [n_kv, 1, 1, ne33]: mostly 0, some -inf, some small biases
    std::vector<half> M((size_t) c.n_kv*c.ne33);
    for (size_t i = 0; i < M.size(); ++i) {
        const uint32_t u = rng() % 10;
        const float v = u == 0 ? -INFINITY : u == 1 ? -0.5f*gauss()*gauss() : 0.0f;
        M[i].bits = ggml_kvq_fp32_to_fp16(v);
    }
    std::vector<float> sinks(n_heads);
    for (float & s : sinks) s = gauss();

    const float scale = 1.0f/sqrtf((float) D);
    const uint32_t n_head_log2 = 1u << (uint32_t) floorf(log2f((float) n_heads));
    const float m0 = powf(2.0f, -(c.max_bias)/n_head_log2);
    const float m1 = powf(2.0f, -(c.max_bias/2.0f)/n_head_log2);

    kvq_fattn_args a = {};
    a.Q = (const char *) Q.data(); a.K = (const char *) K.data(); a.V = (const char *) V.data();
    a.mask = c.mask ? (const char *) M.data() : nullptr;
    a.scale = c.softcap != 0.0f ? scale/c.softcap : scale;
    a.softcap = c.softcap; a.max_bias = c.max_bias; a.m0 = m0; a.m1 = m1; a.n_head_log2 = n_head_log2;
    a.ne02 = n_heads; a.ne11 = c.n_kv; a.gqa = c.gqa;
    a.kv_per_split = c.kv_per_split;
    a.n_split = (c.n_kv + c.kv_per_split - 1)/c.kv_per_split;
    if (a.n_split == 0) a.n_split = 1;
    a.ne32 = 1; a.ne33 = c.ne33;
    a.nb02 = (int64_t) D*4; a.nb03 = a.nb02*n_heads;
    a.nb11 = (int64_t) rbk; a.nb12 = a.nb11*c.n_kv; a.nb13 = a.nb12*c.n_kv_heads;
    a.nb21 = (int64_t) rbv; a.nb22 = a.nb21*c.n_kv; a.nb23 = a.nb22*c.n_kv_heads;
    a.nb32 = (int64_t) c.n_kv*2; a.nb33 = a.nb32;
    memcpy(a.cb_k, cbk, 16); memcpy(a.cb_v, cbv, 16);
    std::vector<float>  part((size_t) c.n_seq*n_heads*a.n_split*D, NAN);
    std::vector<float2> meta((size_t) c.n_seq*n_heads*a.n_split);
    a.part = part.data(); a.meta = meta.data();

    const unsigned n_hb = (unsigned) ((c.gqa + KVQ_FA_G - 1)/KVQ_FA_G);
    emu::launch({ (unsigned) c.n_kv_heads*n_hb, (unsigned) a.n_split, (unsigned) c.n_seq }, { WARP_SIZE, KVQ_FA_NWARPS, 1 },
                [&] { kvq_fattn_vec<D, TK, TV>(a); });
    std::vector<float> out((size_t) c.n_seq*n_heads*D, NAN);
    emu::launch({ (unsigned) n_heads, (unsigned) c.n_seq, 1 }, { D, 1, 1 },
                [&] { kvq_fattn_combine<D>(part.data(), meta.data(), c.sinks ? sinks.data() : nullptr, out.data(), n_heads, a.n_split); });

    // reference, double precision
    double max_err = 0.0, max_ref = 0.0;
    for (int s = 0; s < c.n_seq; ++s) {
        for (int h = 0; h < n_heads; ++h) {
            const int kvh = h / c.gqa;
            const float slope = c.max_bias > 0.0f ? powf(h < (int) n_head_log2 ? m0 : m1, h < (int) n_head_log2 ? h + 1 : 2*(h - (int) n_head_log2) + 1) : 1.0f;
            std::vector<double> sc(c.n_kv);
            double mx = c.sinks ? sinks[h] : -INFINITY;
            for (int k = 0; k < c.n_kv; ++k) {
                const float * kr = &Kd[(((size_t) s*c.n_kv_heads + kvh)*c.n_kv + k)*D];
                const float * qr = &Q[((size_t) s*n_heads + h)*D];
                double dot = 0.0;
                for (int i = 0; i < D; ++i) dot += (double) qr[i]*kr[i];
                double v = dot*scale;
                if (c.softcap != 0.0f) v = c.softcap*tanh(v/c.softcap);
                if (c.mask) v += slope*(double) ggml_kvq_fp16_to_fp32(M[(size_t) (s % c.ne33)*c.n_kv + k].bits);
                sc[k] = v;
                mx = std::max(mx, v);
            }
            double den = c.sinks ? exp(sinks[h] - mx) : 0.0;
            std::vector<double> o(D, 0.0);
            for (int k = 0; k < c.n_kv; ++k) {
                const double p = std::isinf(sc[k]) ? 0.0 : exp(sc[k] - mx);
                den += p;
                const float * vr = &Vd[(((size_t) s*c.n_kv_heads + kvh)*c.n_kv + k)*D];
                for (int i = 0; i < D; ++i) o[i] += p*vr[i];
            }
            for (int i = 0; i < D; ++i) {
                const double ref = den > 0.0 ? o[i]/den : 0.0;
                const double got = out[((size_t) s*n_heads + h)*D + i];
                max_ref = std::max(max_ref, fabs(ref));
                max_err = std::max(max_err, std::isnan(got) ? INFINITY : fabs(got - ref));
            }
        }
    }
    ++cases;
    const bool ok = max_err <= 2e-5*std::max(1.0, max_ref);
    if (!ok) ++failures;
    printf("%s D=%d kv_heads=%d gqa=%d n_kv=%d seq=%d split=%d mask=%d sinks=%d softcap=%g alibi=%g: max err %.2e (max |ref| %.2f) %s\n",
           name, D, c.n_kv_heads, c.gqa, c.n_kv, c.n_seq, a.n_split, c.mask, c.sinks, c.softcap, c.max_bias, max_err, max_ref,
           ok ? "ok" : "FAIL");
}

int main() {
    //                          kvh gqa  n_kv seq split  mask   sinks  softcap alibi ne33
    const Case plain       = {  2,  3,  300,  1,  128, true,  false, 0.0f,  0.0f,  1 };
    const Case one_key     = {  1,  1,    1,  1,  128, true,  false, 0.0f,  0.0f,  1 };
    const Case gqa12       = {  2, 12,  513,  2,  256, true,  false, 0.0f,  0.0f,  1 };
    const Case options     = {  2,  4,  700,  3,  128, true,  true,  10.0f, 8.0f,  3 };
    const Case no_mask     = {  1,  6, 1000,  1,  512, false, true,  0.0f,  0.0f,  1 };
    const Case one_split   = {  3,  3,  257,  1, 1024, true,  false, 0.0f,  0.0f,  1 };
    const Case gqa2        = {  4,  2,  333,  1,  128, true,  true,  0.0f,  0.0f,  1 };
    const Case gqa8        = {  1,  8,  600,  2,  256, true,  false, 0.0f,  0.0f,  2 };

    run_case<128, GGML_TYPE_NUQ4,    GGML_TYPE_NUQ4   >("nuq4/nuq4",       plain);
    run_case<128, GGML_TYPE_NUQ4,    GGML_TYPE_NUQ4   >("nuq4/nuq4",       options);
    run_case< 64, GGML_TYPE_BFP4_32, GGML_TYPE_BFP4_32>("bfp4_32/bfp4_32", gqa12);
    run_case<128, GGML_TYPE_BFP4_64, GGML_TYPE_BFP4_64>("bfp4_64/bfp4_64", one_split);
    run_case< 64, GGML_TYPE_BFP8_32, GGML_TYPE_BFP8_32>("bfp8_32/bfp8_32", one_key);
    run_case<128, GGML_TYPE_NUQ3,    GGML_TYPE_NUQ3   >("nuq3/nuq3",       no_mask);
    run_case< 64, GGML_TYPE_NUQ2,    GGML_TYPE_NUQ2   >("nuq2/nuq2",       plain);
    run_case<128, GGML_TYPE_NUQ3O,   GGML_TYPE_NUQ3O  >("nuq3o/nuq3o",     gqa12);
    run_case< 64, GGML_TYPE_NUQ2O,   GGML_TYPE_NUQ2O  >("nuq2o/nuq2o",     options);
    run_case<128, GGML_TYPE_F16,     GGML_TYPE_NUQ3   >("f16/nuq3",        plain);
    run_case<128, GGML_TYPE_Q8_0,    GGML_TYPE_NUQ3O  >("q8_0/nuq3o",      options);
    run_case< 64, GGML_TYPE_Q8_0,    GGML_TYPE_BFP4_32>("q8_0/bfp4_32",    no_mask);
    run_case<256, GGML_TYPE_NUQ4,    GGML_TYPE_NUQ4   >("nuq4/nuq4",       one_split);
    run_case<128, GGML_TYPE_NUQ4,    GGML_TYPE_NUQ4   >("nuq4/nuq4",       gqa2);
    run_case<128, GGML_TYPE_BFP4_32, GGML_TYPE_BFP4_32>("bfp4_32/bfp4_32", gqa8);
    printf("cases %d failures %d\n", cases, failures);
    return failures != 0;
}
