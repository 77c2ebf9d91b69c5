// The CUDA decode flash-attention kernel (native/ggml/cuda/kvq-fattn.cuh), its very source, run on
// the host under cuda_emu/common.cuh's fiber emulation and compared with attention computed in
// double precision over the same dequantized K / V (the C reference dequantizers). Covers the
// GQA grouping (1, 3 and 12 query heads per KV head: one and two head blocks), KV lengths that
// are and are not multiples of the tiles, one and several splits, sequences with a broadcast
// mask, masked keys, ALiBi, softcap and sinks, f16 / q8_0 K with low-bit V, nuq codebooks.
// A pre-RoPE K cache (kvq-prerope.cuh): the row transform in f32, the prefill path's K -> f16
// conversion (kvq-rows.cuh) and the decode kernel, against ref_prerope_row (double precision,
// pykvq/ref/prerope.py's decode): NORM / NEOX, with and without the Hadamard, partial rotary,
// per-head frequencies, mscale, positions with gaps / out of order / large, 2 streams.
// Built and run by tests/test_cuda.py.
#include "common.cuh"           // the emulator: cuda_emu/ comes first in the include path
#include "kvq-fattn.cuh"
#include "kvq-rows.cuh"

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
        case GGML_TYPE_Q4_0:    // ggml's layout: d = -max/8 as f16, value j in nibble (j < 16 ? low : high) of byte j % 16
            for (int b = 0; b < n/32; ++b) {
                float mx = 0.0f;
                for (int i = 0; i < 32; ++i) if (fabsf(x[32*b + i]) > fabsf(mx)) mx = x[32*b + i];
                const uint16_t dh = ggml_kvq_fp32_to_fp16(mx/-8.0f);
                const float d = ggml_kvq_fp16_to_fp32(dh);
                memcpy(out + 18*b, &dh, 2);
                int q[32];
                for (int i = 0; i < 32; ++i) {
                    q[i] = d == 0.0f ? 8 : std::max(0, std::min(15, (int) (x[32*b + i]/d + 8.5f)));
                    deq[32*b + i] = d*(float) (q[i] - 8);
                }
                for (int i = 0; i < 16; ++i) out[18*b + 2 + i] = (uint8_t) (q[i] | q[i + 16] << 4);
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
        case GGML_TYPE_NUQ3_64: quantize_row_nuq3_64_ref_cb(x, out, n, cb); dequantize_row_nuq3_64_cb(out, deq, n, cb); return;
        case GGML_TYPE_NUQ2_64: quantize_row_nuq2_64_ref_cb(x, out, n, cb); dequantize_row_nuq2_64_cb(out, deq, n, cb); return;
        case GGML_TYPE_Q53_64:  quantize_row_q53_64_ref(x, (block_q53_64 *) out, n); dequantize_row_q53_64((const block_q53_64 *) out, deq, n); return;
        case GGML_TYPE_Q42_64:  quantize_row_q42_64_ref(x, (block_q42_64 *) out, n); dequantize_row_q42_64((const block_q42_64 *) out, deq, n); return;
        case GGML_TYPE_Q32_64:  quantize_row_q32_64_ref(x, (block_q32_64 *) out, n); dequantize_row_q32_64((const block_q32_64 *) out, deq, n); return;
        default: abort();
    }
}

static size_t row_bytes(ggml_type t, int n) {
    switch (t) {
        case GGML_TYPE_F16:     return 2*(size_t) n;
        case GGML_TYPE_Q8_0:    return 34*(size_t) (n/32);
        case GGML_TYPE_Q4_0:    return 18*(size_t) (n/32);
        case GGML_TYPE_BFP4_32: return sizeof(block_bfp4_32)*(size_t) (n/QK_BFP32);
        case GGML_TYPE_BFP4_64: return sizeof(block_bfp4_64)*(size_t) (n/QK_BFP64);
        case GGML_TYPE_BFP8_32: return sizeof(block_bfp8_32)*(size_t) (n/QK_BFP32);
        case GGML_TYPE_Q53_64:  return sizeof(block_q53_64)*(size_t) (n/QK_Q53);
        case GGML_TYPE_Q42_64:  return sizeof(block_q42_64)*(size_t) (n/QK_Q42);
        case GGML_TYPE_Q32_64:  return sizeof(block_q32_64)*(size_t) (n/QK_Q32);
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

// ---- pre-RoPE K: the reference read path ---------------------------------------------------

struct Pre {
    int   n_dims;       // rotated channels
    bool  neox;
    int   n_rot_h;      // 0: no Hadamard
    float mscale;
    bool  per_head;     // per-KV-head frequency factors (K-sort)
    int   pos0;         // first position (large: float angles lose digits)
    int   h_skip;       // a butterfly stride the Hadamard leaves out (keys in halves: 32 on a 128 head); 0: none
    bool  centred;      // a centred post-RoPE K (--kv-domain centred): the cache holds H R(p)(k - mean)
};

// the read path's inputs for n_head_kv heads of size D and n_seq streams of n_kv cells
struct PreData {
    std::vector<float>   mean, scale, w;   // [kvh][D], [kvh][D], [kvh][n_dims/2]
    std::vector<int32_t> pos;              // [seq][n_kv]
    kvq_prerope_args     args;
};

static PreData make_pre(const Pre & P, int D, int n_head_kv, int n_kv, int n_seq) {
    PreData d;
    d.mean.resize((size_t) D*n_head_kv);
    d.scale.resize((size_t) D*n_head_kv);
    for (float & m : d.mean)  m = 20.0f*gauss();          // a k_proj bias: large means
    for (float & s : d.scale) s = expf(0.5f*gauss());
    const int half = P.n_dims/2;
    d.w.resize((size_t) half*n_head_kv);
    for (int h = 0; h < n_head_kv; ++h) {
        for (int i = 0; i < half; ++i) {
            const float ff = P.per_head ? expf(0.3f*gauss()) : 1.0f;
            d.w[(size_t) h*half + i] = powf(10000.0f, -2.0f*i/P.n_dims)/ff;
        }
    }
    // consecutive runs, a gap (removed cells), a block shifted back, one cell out of order; streams apart
    d.pos.resize((size_t) n_kv*n_seq);
    for (int s = 0; s < n_seq; ++s) {
        for (int j = 0; j < n_kv; ++j) {
            int p = P.pos0 + j + (j >= n_kv/3 ? 50 : 0) - (j >= n_kv/2 && j < n_kv/2 + 30 ? 300 : 0);
            if (j == 2*n_kv/3) p = 3;
            d.pos[(size_t) s*n_kv + j] = std::max(0, p) + 1000*s;
        }
    }
    d.args = {};
    d.args.pos = d.pos.data(); d.args.mean = d.mean.data(); d.args.scale = d.scale.data(); d.args.freqs = d.w.data();
    d.args.pos_stride = n_kv;
    d.args.n_dims = P.n_dims; d.args.neox = P.neox; d.args.n_rot_h = P.n_rot_h;
    d.args.h_skip = P.h_skip;
    d.args.h_norm = P.n_rot_h ? (float) (1.0/sqrt((double) (P.h_skip ? P.n_rot_h/2 : P.n_rot_h))) : 1.0f;
    d.args.mscale = P.mscale;
    d.args.centred = P.centred;
    return d;
}

// Hadamard per block of P.n_rot_h (Sylvester order, orthonormal: its own inverse; with a skip, the identity over that
// index bit: ggml_kvq_fa_set_hadamard_skip's matrix) of x [D] in place; none when n_rot_h is 0
static void ref_hadamard(std::vector<double> & x, int D, const Pre & P) {
    if (!P.n_rot_h) {
        return;
    }
    const std::vector<double> in = x;
    const int n = P.n_rot_h, skip = P.h_skip;
    for (int b = 0; b < D; b += n) {
        for (int i = 0; i < n; ++i) {
            double acc = 0.0;
            for (int j = 0; j < n; ++j) {
                if ((i ^ j) & skip) continue;
                acc += (__builtin_popcount(i & j & ~skip) & 1 ? -1.0 : 1.0)*in[b + j];
            }
            x[b + i] = acc/sqrt((double) (skip ? n/2 : n));
        }
    }
}

// RoPE of x [D] (KV head kvh) at position pos, cos and sin times mscale; channels from n_dims on unchanged.
// float_angle: the angle rounded as ggml's rope computes it, (float) pos * w in float; else exact.
static void ref_rope(std::vector<double> & x, int kvh, int pos, const Pre & P, const PreData & d, bool float_angle) {
    const int half = P.n_dims/2;
    for (int i = 0; i < half; ++i) {
        const int a = P.neox ? i : 2*i, b = P.neox ? i + half : 2*i + 1;
        const float  w  = d.w[(size_t) kvh*half + i];
        const double th = float_angle ? (double) ((float) pos*w) : (double) pos*w;
        const double co = cos(th)*P.mscale, si = sin(th)*P.mscale;
        const double xa = x[a], xb = x[b];
        x[a] = xa*co - xb*si;
        x[b] = xa*si + xb*co;
    }
}

// one cached row c (what the cache decodes to) of KV head kvh at position pos -> the key attention reads: pre-RoPE,
// the Hadamard, c*scale + mean, rotation by pos*w; centred, c plus H R(p) mean (the key turned by H, as Q is)
static void ref_prerope_row(const float * c, int D, int kvh, int pos, const Pre & P, const PreData & d, double * out,
                            bool float_angle = false) {
    std::vector<double> x(D);
    if (P.centred) {
        for (int i = 0; i < D; ++i) x[i] = i < P.n_dims ? d.mean[(size_t) kvh*D + i] : 0.0;   // the rotary pairs' mean
        ref_rope(x, kvh, pos, P, d, float_angle);
        ref_hadamard(x, D, P);
        for (int i = 0; i < D; ++i) out[i] = c[i] + x[i];
        return;
    }
    for (int i = 0; i < D; ++i) x[i] = c[i];
    ref_hadamard(x, D, P);
    for (int i = 0; i < D; ++i) x[i] = x[i]*d.scale[(size_t) kvh*D + i] + d.mean[(size_t) kvh*D + i];
    ref_rope(x, kvh, pos, P, d, float_angle);
    for (int i = 0; i < D; ++i) out[i] = x[i];
}

// PRE: a pre-RoPE K cache (P): the cache holds c ~ N(0, 1); the reference attends to the post-RoPE
// keys ref_prerope_row makes of the dequantized c, at ggml's float angles (run_rows measures what
// those cost against exact angles); tol: the allowed max error relative to max(1, max |ref|)
// an exact window over a pre-RoPE cache: n_rows f16 (q8: q8_0) rows [K | V of every KV head]; cells name rows at
// random (some past the last row: read quantized); per_query: planes 2 / 3 (the query's position against each cell's
// last reader), else every named row is read
struct Win {
    int  n_rows;
    bool per_query;
    bool q8 = false;
};

// the window's inputs for n_seq streams of n_kv cells (planes at stride n_kv, like make_pre's positions)
struct WinData {
    std::vector<uint8_t> bytes;               // [n_rows][2*D*n_head_kv] f16 or q8_0 values
    std::vector<float>   vals;                // the same values decoded: what the reference reads
    std::vector<int32_t> row, last, qpos;     // planes 1, 2, 3: [seq][n_kv]
    kvq_window_args      args;
};

// unique: no two cells of a stream name the same row (the prefill stand-in shows a row for one cell only)
static WinData make_win(const Win & W, int D, int n_head_kv, int n_kv, int n_seq, int n_q, bool unique) {
    WinData w;
    const int64_t rl = 2*(int64_t) D*n_head_kv;
    const int64_t rb = W.q8 ? rl/32*34 : rl*2;
    w.bytes.resize((size_t) W.n_rows*rb);
    w.vals.resize((size_t) W.n_rows*rl);
    for (int64_t b = 0; b < (int64_t) W.n_rows*rl; b += 32) {   // q8_0 as ggml quantizes it: d = amax/127
        float x[32], amax = 0.0f;
        for (int i = 0; i < 32; ++i) { x[i] = gauss(); amax = std::max(amax, fabsf(x[i])); }
        uint8_t * o = &w.bytes[(size_t) (b/rl)*rb + (size_t) (W.q8 ? (b % rl)/32*34 : (b % rl)*2)];
        const uint16_t dh = ggml_kvq_fp32_to_fp16(amax/127.0f);
        for (int i = 0; i < 32; ++i) {
            if (W.q8) {
                const int8_t q = (int8_t) roundf(x[i]*(127.0f/amax));
                o[2 + i] = (uint8_t) q;
                w.vals[b + i] = ggml_kvq_fp16_to_fp32(dh)*q;
            } else {
                const uint16_t h = ggml_kvq_fp32_to_fp16(x[i]);
                memcpy(o + 2*i, &h, 2);
                w.vals[b + i] = ggml_kvq_fp16_to_fp32(h);
            }
        }
        if (W.q8) memcpy(o, &dh, 2);
    }
    w.row.assign((size_t) n_seq*n_kv, -1);
    w.last.assign((size_t) n_seq*n_kv, 0);
    w.qpos.assign((size_t) n_seq*n_kv, 0);
    for (int s = 0; s < n_seq; ++s) {
        std::vector<int> free_rows(W.n_rows);
        for (int r = 0; r < W.n_rows; ++r) free_rows[r] = r;
        std::shuffle(free_rows.begin(), free_rows.end(), rng);
        for (int j = 0; j < n_q; ++j) {
            w.qpos[(size_t) s*n_kv + j] = 500 + 3*j;
        }
        for (int k = 0; k < n_kv; ++k) {
            const uint32_t u = rng() % 20;
            int32_t r = -1;
            if (u < 7) {
                if (!unique) {
                    r = (int32_t) (rng() % W.n_rows);
                } else if (!free_rows.empty()) {
                    r = free_rows.back();
                    free_rows.pop_back();
                }
            } else if (u == 7) {
                r = W.n_rows + (int32_t) (rng() % 5);   // past the last row: the quantized cell
            }
            w.row[(size_t) s*n_kv + k] = r;
            // last reader: around the queries' positions, sometimes equal to one, sometimes a sink (INT32_MAX)
            w.last[(size_t) s*n_kv + k] = u % 5 == 0 ? INT32_MAX : 500 + (int32_t) (rng() % (3*n_q + 4)) - 2;
        }
    }
    w.args = {};
    w.args.rows = (const char *) w.bytes.data();
    w.args.q8   = W.q8;
    w.args.row  = w.row.data();
    w.args.last = W.per_query ? w.last.data() : nullptr;
    w.args.qpos = W.per_query ? w.qpos.data() : nullptr;
    w.args.nb1  = rb;
    w.args.v0   = (int64_t) D*n_head_kv;
    w.args.n    = W.n_rows;
    return w;
}

// the row query j of stream s reads for cell k (the kernels' rule, written out), or -1
static int win_row_ref(const WinData & w, const Win & W, int n_kv, int s, int j, int k) {
    const int32_t r = w.row[(size_t) s*n_kv + k];
    if (r < 0 || r >= W.n_rows) return -1;
    return !W.per_query || w.qpos[(size_t) s*n_kv + j] <= w.last[(size_t) s*n_kv + k] ? r : -1;
}

template <int D, ggml_type TK, ggml_type TV, bool PRE = false>
static void run_case(const char * name, const Case & c, const Pre * P = nullptr, double tol = 2e-5, const Win * W = nullptr) {
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
    PreData pd;
    if (PRE) {
        pd = make_pre(*P, D, c.n_kv_heads, c.n_kv, c.n_seq);
    }
    std::vector<double> kpost(D);
    for (size_t r = 0; r < n_rows; ++r) {
        for (int i = 0; i < D; ++i) x[i] = gauss()*(i % 7 == 0 && !PRE ? 4.0f : 1.0f);
        encode_row(TK, x.data(), D, cbk, &K[r*rbk], &Kd[r*D]);
        if (PRE) {   // row r is cell k of KV head kvh in stream s
            const int k = (int) (r % c.n_kv), kvh = (int) ((r / c.n_kv) % c.n_kv_heads), s = (int) (r / c.n_kv / c.n_kv_heads);
            ref_prerope_row(&Kd[r*D], D, kvh, pd.pos[(size_t) s*c.n_kv + k], *P, pd, kpost.data(), true);
            for (int i = 0; i < D; ++i) Kd[r*D + i] = (float) kpost[i];
        }
        for (int i = 0; i < D; ++i) x[i] = gauss();
        encode_row(TV, x.data(), D, cbv, &V[r*rbv], &Vd[r*D]);
    }
    WinData wd;
    int n_exact = 0;
    if (PRE && W) {   // decode: query 0 of each stream; its exact rows replace the cells' values in the reference
        wd = make_win(*W, D, c.n_kv_heads, c.n_kv, c.n_seq, 1, false);
        std::vector<float> wx(D);
        for (int s = 0; s < c.n_seq; ++s) {
            for (int k = 0; k < c.n_kv; ++k) {
                const int r = win_row_ref(wd, *W, c.n_kv, s, 0, k);
                if (r < 0) continue;
                ++n_exact;
                for (int kvh = 0; kvh < c.n_kv_heads; ++kvh) {
                    const size_t rr = ((size_t) s*c.n_kv_heads + kvh)*c.n_kv + k;
                    const float * wk = &wd.vals[(size_t) r*2*D*c.n_kv_heads + (size_t) kvh*D];
                    const float * wv = wk + (size_t) D*c.n_kv_heads;
                    for (int i = 0; i < D; ++i) wx[i] = wk[i];
                    ref_prerope_row(wx.data(), D, kvh, pd.pos[(size_t) s*c.n_kv + k], *P, pd, kpost.data(), true);
                    for (int i = 0; i < D; ++i) {
                        Kd[rr*D + i] = (float) kpost[i];
                        Vd[rr*D + i] = wv[i];
                    }
                }
            }
        }
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
    if (PRE) {
        a.pre = pd.args;
        if (W) {
            a.win = wd.args;
        }
    }
    std::vector<float>  part((size_t) c.n_seq*n_heads*a.n_split*D, NAN);
    std::vector<float2> meta((size_t) c.n_seq*n_heads*a.n_split);
    a.part = part.data(); a.meta = meta.data();

    const int      G    = kvq_fattn_vec_g(c.gqa);   // as the launch picks it: 4 or 8 heads per block
    const unsigned n_hb = (unsigned) ((c.gqa + G - 1)/G);
    emu::launch({ (unsigned) c.n_kv_heads*n_hb, (unsigned) a.n_split, (unsigned) c.n_seq }, { WARP_SIZE, KVQ_FA_NWARPS, 1 },
                [&] { if (G == 4) kvq_fattn_vec<D, TK, TV, PRE, 4>(a); else kvq_fattn_vec<D, TK, TV, PRE, KVQ_FA_G>(a); });
    std::vector<float> out((size_t) c.n_seq*n_heads*D, NAN);
    emu::launch({ (unsigned) n_heads, (unsigned) c.n_seq, 1 }, { WARP_SIZE, D/WARP_SIZE, 1 },
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
    const bool ok = max_err <= tol*std::max(1.0, max_ref);
    if (!ok) ++failures;
    if (PRE) {
        printf("pre-RoPE %s n_dims=%d rot=%d pos0=%d ", P->neox ? "NEOX" : "NORM", P->n_dims, P->n_rot_h, P->pos0);
    }
    if (W) {
        printf("window rows=%d %s per_query=%d exact cells=%d ", W->n_rows, W->q8 ? "q8_0" : "f16", W->per_query, n_exact);
        if (n_exact == 0) ++failures;   // a window case that reads no row tests nothing
    }
    printf("%s D=%d kv_heads=%d gqa=%d n_kv=%d seq=%d split=%d mask=%d sinks=%d softcap=%g alibi=%g: max err %.2e (max |ref| %.2f) %s\n",
           name, D, c.n_kv_heads, c.gqa, c.n_kv, c.n_seq, a.n_split, c.mask, c.sinks, c.softcap, c.max_bias, max_err, max_ref,
           ok ? "ok" : "FAIL");
}

// ---- pre-RoPE K rows: the row transform (f32) and the prefill conversion (f16) ----------------

// the decode kernel's use of kvq_prerope_row, one warp per cached row, written out as f32
template <int D, ggml_type T>
static void prerope_rows_f32(const char * K, int64_t rb, float * out, const kvq_prerope_args p, const float * cb,
                             int n_kv, int n_head_kv, int64_t n_rows) {
    constexpr int EPL = D / WARP_SIZE;
    const int lane = threadIdx.x;
    const int64_t row = (int64_t) blockIdx.x*blockDim.y + threadIdx.y;
    if (row >= n_rows) {
        return;
    }
    const int j = (int) (row % n_kv), kvh = (int) ((row / n_kv) % n_head_kv), s = (int) (row / ((int64_t) n_kv*n_head_kv));
    kvq_prerope_lane<EPL> L;
    kvq_prerope_lane_init<EPL>(L, p, kvh, D, lane);
    float x[EPL];
    kvq_fa_load<T, EPL>(K + row*rb, lane*EPL, cb, x);
    kvq_prerope_row<EPL>(x, p.pos[s*p.pos_stride + j], L, p);
    for (int e = 0; e < EPL; ++e) {
        out[row*D + lane*EPL + e] = x[e];
    }
}

static double max_rel_f32 = 0.0, max_rel_f16 = 0.0;

// rows of n_seq streams x n_head_kv heads x n_kv cells: the f32 transform within tol of the reference
// with exact angles (relative to the row's largest value) and within 1e-4 of the one with ggml's float
// angles; the f16 conversion within the same plus f16 rounding (2^-11 relative)
template <int D, ggml_type T>
static void run_rows(const char * name, const Pre & P, int n_head_kv, int n_kv, int n_seq, double tol) {
    int8_t cb[16] = {0};
    float  cbf[16] = {0};
    if (ggml_kvq_is_nuq(T)) random_codebook(cb, ggml_kvq_nuq_n_codes(T));
    for (int i = 0; i < 16; ++i) cbf[i] = cb[i];
    kvq_cb kcb;
    memcpy(kcb.c, cb, 16);
    const PreData pd = make_pre(P, D, n_head_kv, n_kv, n_seq);
    const int64_t n_rows = (int64_t) n_kv*n_head_kv*n_seq;
    const size_t rb = row_bytes(T, D);
    std::vector<uint8_t> K(rb*n_rows);
    std::vector<float> Cd((size_t) D*n_rows), x(D);
    for (int64_t r = 0; r < n_rows; ++r) {
        for (int i = 0; i < D; ++i) x[i] = gauss();
        encode_row(T, x.data(), D, cb, &K[r*rb], &Cd[r*D]);
    }
    std::vector<float> out32((size_t) D*n_rows, NAN);
    const unsigned nw = 4, nb = (unsigned) ((n_rows + nw - 1)/nw);
    emu::launch({ nb, 1, 1 }, { WARP_SIZE, nw, 1 }, [&] {
        prerope_rows_f32<D, T>((const char *) K.data(), (int64_t) rb, out32.data(), pd.args, cbf, n_kv, n_head_kv, n_rows);
    });
    // the prefill path's conversion; f16 rows in place (src is dst)
    std::vector<half> out16((size_t) D*n_rows);
    const char * src = (const char *) K.data();
    half * dst = out16.data();
    if (T == GGML_TYPE_F16) {
        dst = (half *) K.data();
    }
    emu::launch({ nb, 1, 1 }, { WARP_SIZE, nw, 1 }, [&] {
        kvq_prerope_k_to_f16<D, T>(src, dst, pd.args, kcb, n_kv, n_head_kv, n_rows, (int64_t) rb, (int64_t) rb*n_kv,
                                   (int64_t) rb*n_kv*n_head_kv);
    });
    double e32 = 0.0, e16 = 0.0, ef = 0.0;
    bool ok = true;
    std::vector<double> ref(D), reff(D);
    for (int64_t r = 0; r < n_rows; ++r) {
        const int j = (int) (r % n_kv), kvh = (int) ((r / n_kv) % n_head_kv), s = (int) (r / ((int64_t) n_kv*n_head_kv));
        ref_prerope_row(&Cd[r*D], D, kvh, pd.pos[(size_t) s*n_kv + j], P, pd, ref.data());
        ref_prerope_row(&Cd[r*D], D, kvh, pd.pos[(size_t) s*n_kv + j], P, pd, reff.data(), true);
        double mx = 1.0;
        for (int i = 0; i < D; ++i) mx = std::max(mx, fabs(ref[i]));
        for (int i = 0; i < D; ++i) {
            const double d32 = fabs(out32[r*D + i] - ref[i]);
            const double g16 = __half2float(dst[r*D + i]);
            const double d16 = fabs(g16 - ref[i]);
            e32 = std::max(e32, std::isnan(out32[r*D + i]) ? INFINITY : d32/mx);
            e16 = std::max(e16, std::isnan(g16) ? INFINITY : std::max(0.0, d16 - fabs(ref[i])/2048.0)/mx);
            const double df = fabs(out32[r*D + i] - reff[i]);
            ef  = std::max(ef, df/mx);
            ok = ok && d32 <= tol*mx && d16 <= tol*mx + fabs(ref[i])/2048.0 && df <= 1e-4*mx;
        }
    }
    ++cases;
    if (!ok) ++failures;
    if (P.pos0 < 10000) {
        max_rel_f32 = std::max(max_rel_f32, e32);
        max_rel_f16 = std::max(max_rel_f16, e16);
    }
    printf("pre-RoPE rows %s D=%d %s n_dims=%d rot=%d mscale=%g per_head=%d pos0=%d kv_heads=%d n_kv=%d streams=%d: "
           "max err f32 %.2e, f16 beyond rounding %.2e (of the row's max |k|, tol %.0e); f32 vs float angles %.2e %s\n",
           name, D, P.neox ? "NEOX" : "NORM", P.n_dims, P.n_rot_h, P.mscale, P.per_head, P.pos0, n_head_kv, n_kv, n_seq,
           e32, e16, tol, ef, ok ? "ok" : "FAIL");
}

// ---- exact window in prefill: the stand-in upstream's f16 kernel reads (kvq-window.cuh) ----------

// n_q queries per stream over n_kv cells with a window of W.n_rows rows: kvq_win_inverse / _positions, the rows'
// keys by the prefill conversion, kvq_win_assemble and kvq_win_mask build the appended K / V and the mask; attention
// over them (what upstream's kernel computes, here in double) against attention that reads, query by query, each
// cell's exact row or its cached value (win_row_ref). The cache's K is post-RoPE f16 already (the prefill path's
// conversion, tested above); the rows' keys turn at their cells' positions (float angles).
template <int D>
static void run_window_prefill(const char * name, const Pre & P, const Win & W, int n_head_kv, int gqa, int n_kv,
                               int n_seq, int n_q, double tol) {
    const int n_head = n_head_kv*gqa;
    const int n_qpad = (n_q + 63)/64*64;
    PreData pd = make_pre(P, D, n_head_kv, n_kv, n_seq);
    WinData wd = make_win(W, D, n_head_kv, n_kv, n_seq, n_q, true);
    // the cache as the prefill path hands it on: post-RoPE f16 [D, n_kv, n_head_kv, n_seq], and f16 V
    const size_t n_rows = (size_t) n_kv*n_head_kv*n_seq;
    std::vector<half> K16(n_rows*D), V16(n_rows*D);
    for (half & h : K16) h.bits = ggml_kvq_fp32_to_fp16(2.0f*gauss());
    for (half & h : V16) h.bits = ggml_kvq_fp32_to_fp16(gauss());
    std::vector<half> M((size_t) n_kv*n_qpad*n_seq);
    for (size_t i = 0; i < M.size(); ++i) {
        const uint32_t u = rng() % 10;
        M[i].bits = ggml_kvq_fp32_to_fp16(u == 0 ? -INFINITY : u == 1 ? -0.5f*gauss()*gauss() : 0.0f);
    }
    std::vector<float> Q((size_t) D*n_q*n_head*n_seq);   // [D, n_q, n_head, n_seq]
    for (float & q : Q) q = gauss();

    const int n_w   = W.n_rows;
    const int n_all = (n_kv + n_w + 255)/256*256;
    const int64_t rk = (int64_t) D*sizeof(half);
    std::vector<int32_t> inv((size_t) n_w*n_seq, -1), pos_w((size_t) n_w*n_seq);
    const unsigned tb = 128;
    auto blocks = [&](int64_t n) { return (unsigned) ((n + tb - 1)/tb); };
    emu::launch({ blocks((int64_t) n_kv*n_seq), 1, 1 }, { tb, 1, 1 }, [&] {
        kvq_win_inverse(wd.args, n_kv, n_kv, n_seq, inv.data());
    });
    emu::launch({ blocks((int64_t) n_w*n_seq), 1, 1 }, { tb, 1, 1 }, [&] {
        kvq_win_positions(inv.data(), pd.pos.data(), n_kv, n_w, n_seq, pos_w.data());
    });
    kvq_prerope_args pw = pd.args;
    pw.pos = pos_w.data();
    pw.pos_stride = n_w;
    std::vector<half> kw((size_t) D*n_w*n_head_kv*n_seq);
    const int64_t n_wrows = (int64_t) n_w*n_head_kv*n_seq;
    const kvq_cb none = {};
    emu::launch({ (unsigned) ((n_wrows + 3)/4), 1, 1 }, { WARP_SIZE, 4, 1 }, [&] {
        if (W.q8) {
            kvq_prerope_k_to_f16<D, GGML_TYPE_Q8_0>(wd.args.rows, kw.data(), pw, none, n_w, n_head_kv, n_wrows, wd.args.nb1,
                                                    kvq_window_offset(wd.args, D), 0);
        } else {
            kvq_prerope_k_to_f16<D, GGML_TYPE_F16>(wd.args.rows, kw.data(), pw, none, n_w, n_head_kv, n_wrows, wd.args.nb1, rk, 0);
        }
    });
    const int64_t n_out = (int64_t) D*n_all*n_head_kv*n_seq;
    std::vector<half> Ka(n_out), Va(n_out), Ma((size_t) n_all*n_qpad*n_seq);
    emu::launch({ blocks(n_out), 1, 1 }, { tb, 1, 1 }, [&] {
        kvq_win_assemble((const char *) K16.data(), rk, rk*n_kv, rk*n_kv*n_head_kv, (const char *) kw.data(), rk, rk*n_w,
                         rk*n_w*n_head_kv, false, D, n_kv, n_w, n_all, n_head_kv, n_seq, Ka.data());
    });
    emu::launch({ blocks(n_out), 1, 1 }, { tb, 1, 1 }, [&] {
        kvq_win_assemble((const char *) V16.data(), rk, rk*n_kv, rk*n_kv*n_head_kv, wd.args.rows + kvq_window_offset(wd.args, wd.args.v0),
                         wd.args.nb1, kvq_window_offset(wd.args, D), 0, W.q8, D, n_kv, n_w, n_all, n_head_kv, n_seq, Va.data());
    });
    emu::launch({ blocks((int64_t) Ma.size()), 1, 1 }, { tb, 1, 1 }, [&] {
        kvq_win_mask((const char *) M.data(), (int64_t) n_kv*2, (int64_t) n_kv*n_qpad*2, (int64_t) n_kv*n_qpad*2, n_seq,
                     wd.args, n_kv, inv.data(), n_kv, n_all, n_q, n_qpad, 1, n_seq, Ma.data());
    });

    // attention of query (s, h, j) over n columns: key / value / mask of column c by the callbacks
    auto attend = [&](int n, auto key, auto val, auto msk, const float * q, double * o) {
        std::vector<double> sc(n);
        double mx = -INFINITY;
        for (int c = 0; c < n; ++c) {
            const double m = msk(c);
            if (std::isinf(m)) { sc[c] = -INFINITY; continue; }
            const half * k = key(c);
            double dot = 0.0;
            for (int i = 0; i < D; ++i) dot += (double) q[i]*__half2float(k[i]);
            sc[c] = dot/sqrt((double) D) + m;
            mx = std::max(mx, sc[c]);
        }
        double den = 0.0;
        for (int i = 0; i < D; ++i) o[i] = 0.0;
        for (int c = 0; c < n; ++c) {
            if (std::isinf(sc[c])) continue;
            const double p = exp(sc[c] - mx);
            den += p;
            const half * v = val(c);
            for (int i = 0; i < D; ++i) o[i] += p*__half2float(v[i]);
        }
        for (int i = 0; i < D; ++i) o[i] = den > 0.0 ? o[i]/den : 0.0;
    };
    // the reference's exact values: the rows' as upstream's f16 kernel reads them (f16 rows: the same bits)
    std::vector<half> vref(wd.vals.size());
    for (size_t i = 0; i < vref.size(); ++i) vref[i].bits = ggml_kvq_fp32_to_fp16(wd.vals[i]);
    // the reference's exact keys: each named row turned at its cell's position, rounded to f16 as the cache's
    std::vector<half> kref((size_t) n_w*n_head_kv*n_seq*D);
    std::vector<double> kpost(D);
    std::vector<float> wx(D);
    for (int s = 0; s < n_seq; ++s) {
        for (int k = 0; k < n_kv; ++k) {
            const int32_t r = wd.row[(size_t) s*n_kv + k];
            if (r < 0 || r >= n_w) continue;
            for (int kvh = 0; kvh < n_head_kv; ++kvh) {
                const float * wk = &wd.vals[(size_t) r*2*D*n_head_kv + (size_t) kvh*D];
                for (int i = 0; i < D; ++i) wx[i] = wk[i];
                ref_prerope_row(wx.data(), D, kvh, pd.pos[(size_t) s*n_kv + k], P, pd, kpost.data(), true);
                for (int i = 0; i < D; ++i) kref[(((size_t) s*n_head_kv + kvh)*n_w + r)*D + i].bits = ggml_kvq_fp32_to_fp16((float) kpost[i]);
            }
        }
    }
    double max_err = 0.0, max_ref = 0.0;
    int n_exact = 0, n_mixed_cells = 0;
    std::vector<double> o1(D), o2(D);
    for (int s = 0; s < n_seq; ++s) {
        for (int k = 0; k < n_kv; ++k) {   // cells some queries read exactly and others not
            bool any = false, all = true;
            for (int j = 0; j < n_q; ++j) {
                const bool e = win_row_ref(wd, W, n_kv, s, j, k) >= 0;
                any = any || e;
                all = all && e;
            }
            n_mixed_cells += any && !all;
        }
        for (int h = 0; h < n_head; ++h) {
            const int kvh = h / gqa;
            for (int j = 0; j < n_q; ++j) {
                const float * q = &Q[(((size_t) s*n_head + h)*n_q + j)*D];
                const size_t hb = ((size_t) s*n_head_kv + kvh);
                attend(n_all,
                       [&](int c) { return &Ka[(hb*n_all + c)*D]; },
                       [&](int c) { return &Va[(hb*n_all + c)*D]; },
                       [&](int c) { return (double) __half2float(Ma[((size_t) s*n_qpad + j)*n_all + c]); }, q, o1.data());
                attend(n_kv,
                       [&](int c) {
                           const int r = win_row_ref(wd, W, n_kv, s, j, c);
                           return r >= 0 ? &kref[(hb*n_w + r)*D] : &K16[(hb*n_kv + c)*D];
                       },
                       [&](int c) {
                           const int r = win_row_ref(wd, W, n_kv, s, j, c);
                           return r >= 0 ? &vref[(size_t) r*2*D*n_head_kv + (size_t) (n_head_kv + kvh)*D] : &V16[(hb*n_kv + c)*D];
                       },
                       [&](int c) { return (double) __half2float(M[((size_t) s*n_qpad + j)*n_kv + c]); }, q, o2.data());
                for (int c = 0; c < n_kv && h == 0; ++c) n_exact += win_row_ref(wd, W, n_kv, s, j, c) >= 0;
                for (int i = 0; i < D; ++i) {
                    max_ref = std::max(max_ref, fabs(o2[i]));
                    max_err = std::max(max_err, fabs(o1[i] - o2[i]));
                }
            }
        }
    }
    ++cases;
    const bool ok = max_err <= tol*std::max(1.0, max_ref) && n_exact > 0 && (!W.per_query || n_mixed_cells > 0);
    if (!ok) ++failures;
    printf("window prefill %s D=%d kv_heads=%d gqa=%d n_kv=%d rows=%d %s (%d with padding) streams=%d queries=%d per_query=%d: "
           "exact (query, cell) pairs %d, cells read exactly by some queries only %d; max err %.2e (max |ref| %.2f) %s\n",
           name, D, n_head_kv, gqa, n_kv, n_w, W.q8 ? "q8_0" : "f16", n_all, n_seq, n_q, W.per_query, n_exact, n_mixed_cells, max_err, max_ref,
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
    run_case<128, GGML_TYPE_NUQ3_64, GGML_TYPE_NUQ3_64>("nuq3_64/nuq3_64", gqa12);
    run_case< 64, GGML_TYPE_Q8_0,    GGML_TYPE_NUQ2_64>("q8_0/nuq2_64",    options);
    run_case<128, GGML_TYPE_F16,     GGML_TYPE_NUQ3   >("f16/nuq3",        plain);
    run_case<128, GGML_TYPE_Q8_0,    GGML_TYPE_NUQ3O  >("q8_0/nuq3o",      options);
    run_case< 64, GGML_TYPE_Q8_0,    GGML_TYPE_BFP4_32>("q8_0/bfp4_32",    no_mask);
    run_case<256, GGML_TYPE_NUQ4,    GGML_TYPE_NUQ4   >("nuq4/nuq4",       one_split);
    run_case<128, GGML_TYPE_NUQ4,    GGML_TYPE_NUQ4   >("nuq4/nuq4",       gqa2);
    run_case<128, GGML_TYPE_BFP4_32, GGML_TYPE_BFP4_32>("bfp4_32/bfp4_32", gqa8);

    // pre-RoPE K.          n_dims neox   rot  mscale per_head pos0
    const Pre norm128   = { 128, false, 128, 1.0f, false,    7 };
    const Pre neox64    = {  64, true,   64, 1.0f, false,    7 };
    const Pre neox_part = {  96, true,   32, 1.2f, true,     7 };   // partial rotary, K-sort factors, YaRN-like mscale
    const Pre norm_part = {  40, false,   0, 1.0f, true,     7 };
    const Pre norm_h2   = { 128, false,   2, 1.0f, false,    7 };   // a Hadamard smaller than a lane's values
    const Pre neox256   = { 256, true,    0, 1.0f, false,    7 };
    const Pre norm_h16  = {  64, false,  16, 1.0f, true,     7 };
    const Pre far_norm  = {  64, false,  64, 1.0f, false, 30000 };  // large positions: float angles
    const Pre far_neox  = { 128, true,  128, 1.0f, true,  30000 };
    const double tol = 1e-4, tol_far = 2e-3;
    run_rows<128, GGML_TYPE_NUQ4   >("nuq4",    norm128,   2, 100, 2, tol);
    run_rows< 64, GGML_TYPE_BFP4_32>("bfp4_32", neox64,    2, 100, 2, tol);
    run_rows<128, GGML_TYPE_Q8_0   >("q8_0",    neox_part, 2, 100, 2, tol);
    run_rows< 64, GGML_TYPE_F16    >("f16",     norm_part, 3,  70, 1, tol);
    run_rows<128, GGML_TYPE_NUQ3O  >("nuq3o",   norm_h2,   1, 100, 2, tol);
    run_rows<256, GGML_TYPE_BFP8_32>("bfp8_32", neox256,   1,  60, 1, tol);
    run_rows< 64, GGML_TYPE_NUQ2   >("nuq2",    far_norm,  2,  60, 2, tol_far);
    run_rows<128, GGML_TYPE_F16    >("f16",     far_neox,  2,  60, 1, tol_far);
    // keys in halves (q53_64 / q42_64 / q32_64): on a 128 head the Hadamard leaves out its stride-32 butterfly
    const Pre neox_q53  = { 128, true,  128, 1.0f, false,    7, 32 };
    const Pre norm_q53  = { 128, false, 128, 1.0f, true,     7, 32 };
    const Pre neox64_32 = {  64, true,   32, 1.0f, false,    7 };
    run_rows<128, GGML_TYPE_Q53_64 >("q53_64",  neox_q53,  2, 100, 2, tol);
    run_rows<128, GGML_TYPE_Q42_64 >("q42_64",  norm_q53,  2, 100, 1, tol);
    run_rows< 64, GGML_TYPE_Q53_64 >("q53_64",  neox64_32, 2,  70, 1, tol);
    run_rows<256, GGML_TYPE_Q42_64 >("q42_64",  neox_q53,  1,  60, 1, tol);
    run_rows<128, GGML_TYPE_Q32_64 >("q32_64",  norm_q53,  2,  80, 1, tol);
    // centred post-RoPE K (--kv-domain centred): the mean rotated at each position and turned by H, added back
    const Pre cen_norm  = {  64, false,  64, 1.0f, true,     7, 0, true };
    const Pre cen_neox  = { 128, true,  128, 1.2f, false,    7, 0, true };
    const Pre cen_part  = {  96, true,   32, 1.0f, true,     7, 0, true };
    const Pre cen_q53   = { 128, true,  128, 1.0f, false,    7, 32, true };
    run_rows< 64, GGML_TYPE_BFP4_32>("bfp4_32 centred", cen_norm, 2, 100, 2, tol);
    run_rows<128, GGML_TYPE_NUQ4   >("nuq4 centred",   cen_neox, 2, 100, 1, tol);
    run_rows<128, GGML_TYPE_Q8_0   >("q8_0 centred",   cen_part, 2,  80, 1, tol);
    run_rows<128, GGML_TYPE_Q53_64 >("q53_64 centred", cen_q53,  1,  80, 1, tol);

    //                          kvh gqa  n_kv seq split  mask   sinks  softcap alibi ne33
    const Case pre_streams = {  2,  3,  300,  2,  128, true,  false, 0.0f,  0.0f,  2 };
    const Case pre_gqa8    = {  1,  8,  257,  1,  128, true,  true,  0.0f,  0.0f,  1 };
    run_case<128, GGML_TYPE_NUQ4,    GGML_TYPE_NUQ4,    true>("nuq4/nuq4",       pre_streams, &norm128,   tol);
    run_case< 64, GGML_TYPE_BFP4_32, GGML_TYPE_BFP4_32, true>("bfp4_32/bfp4_32", pre_streams, &neox64,    tol);
    run_case<128, GGML_TYPE_Q8_0,    GGML_TYPE_NUQ3O,   true>("q8_0/nuq3o",      pre_gqa8,    &neox_part, tol);
    run_case< 64, GGML_TYPE_NUQ3,    GGML_TYPE_NUQ3,    true>("nuq3/nuq3",       pre_gqa8,    &norm_part, tol);
    run_case<256, GGML_TYPE_NUQ4,    GGML_TYPE_NUQ4,    true>("nuq4/nuq4",       one_split,   &neox256,   tol);
    run_case< 64, GGML_TYPE_BFP8_32, GGML_TYPE_BFP8_32, true>("bfp8_32/bfp8_32", pre_streams, &far_norm,  tol);
    run_case<128, GGML_TYPE_Q4_0,    GGML_TYPE_Q4_0,    true>("q4_0/q4_0",       pre_streams, &neox_part, tol);   // pre-RoPE only pairs
    run_case< 64, GGML_TYPE_NUQ4,    GGML_TYPE_F16,     true>("nuq4/f16",        pre_gqa8,    &norm_h16, tol);
    run_case<128, GGML_TYPE_Q53_64,  GGML_TYPE_Q4_0,    true>("q53_64/q4_0",     pre_streams, &neox_q53,  tol);
    run_case<128, GGML_TYPE_Q42_64,  GGML_TYPE_NUQ3,    true>("q42_64/nuq3",     pre_gqa8,    &norm_q53,  tol);
    run_case< 64, GGML_TYPE_Q42_64,  GGML_TYPE_NUQ2O,   true>("q42_64/nuq2o",    pre_streams, &neox64_32, tol);
    run_case<128, GGML_TYPE_Q32_64,  GGML_TYPE_NUQ2O,   true>("q32_64/nuq2o",    pre_gqa8,    &neox_q53,  tol);
    run_case<128, GGML_TYPE_Q42_64,  GGML_TYPE_NUQ3_64, true>("q42_64/nuq3_64",  pre_streams, &neox_q53,  tol);
    run_case< 64, GGML_TYPE_Q32_64,  GGML_TYPE_NUQ2_64, true>("q32_64/nuq2_64",  pre_gqa8,    &neox64_32, tol);
    run_case< 64, GGML_TYPE_Q4_0,    GGML_TYPE_Q4_0,    true>("q4_0/q4_0 centred", pre_streams, &cen_norm, tol);
    run_case<128, GGML_TYPE_NUQ4,    GGML_TYPE_NUQ4,    true>("nuq4/nuq4 centred", pre_gqa8,    &cen_neox, tol);
    run_case<128, GGML_TYPE_Q8_0,    GGML_TYPE_NUQ3O,   true>("q8_0/nuq3o centred", pre_streams, &cen_part, tol);
    // exact window: the decode kernel reads a cell's row when the query's planes say so; prefill's stand-in
    const Win win_q   = { 40, true  };
    const Win win_all = { 24, false };
    const Win win_q8  = { 40, true, true };   // rows in q8_0 (--kv-window-type q8_0)
    const Win win_q8a = { 24, false, true };
    run_case<128, GGML_TYPE_Q4_0,    GGML_TYPE_Q4_0,    true>("q4_0/q4_0",       pre_streams, &neox_part, tol, &win_q);
    run_case< 64, GGML_TYPE_NUQ3,    GGML_TYPE_NUQ3,    true>("nuq3/nuq3",       pre_gqa8,    &norm_h16,  tol, &win_q);
    run_case< 64, GGML_TYPE_BFP4_32, GGML_TYPE_BFP4_32, true>("bfp4_32/bfp4_32", pre_streams, &neox64,    tol, &win_all);
    run_case<128, GGML_TYPE_Q42_64,  GGML_TYPE_NUQ3_64, true>("q42_64/nuq3_64",  pre_streams, &neox_q53,  tol, &win_q8);
    run_case< 64, GGML_TYPE_Q4_0,    GGML_TYPE_Q4_0,    true>("q4_0/q4_0",       pre_gqa8,    &neox64,    tol, &win_q8a);
    run_window_prefill<128>("NEOX partial", neox_part, win_q,   2, 3, 300, 2, 7, 1e-3);
    run_window_prefill< 64>("NORM",         norm_h16,  win_all, 1, 8, 200, 1, 5, 1e-3);
    run_window_prefill<128>("NEOX partial", neox_part, win_q8,  2, 3, 300, 2, 7, 1e-3);
    run_window_prefill< 64>("NORM",         norm_h16,  win_q8a, 1, 8, 200, 1, 5, 1e-3);
    printf("pre-RoPE rows below position 10000: max err f32 %.2e, f16 beyond rounding %.2e\n", max_rel_f32, max_rel_f16);
    printf("cases %d failures %d\n", cases, failures);
    return failures != 0;
}
