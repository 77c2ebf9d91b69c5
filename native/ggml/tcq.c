// tcq3_64 / tcq2_64 (and tcq3_128 / tcq2_128: two runs under one scale; tcq25_64: 3 and 2 bits by turns):
// trellis-coded quantization (ggml-kvq.h has the format): the reference quantizer and dequantizer (ggml-base). The
// rule is pykvq/ref/tcq.py's; the tests hold this file to it bit for bit, so every product is rounded before it is
// added (no fused multiply-add) and sums run in double, in order.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "ggml-kvq.h"
#include "tcq-tables.h"

#include <float.h>
#include <math.h>
#include <string.h>

#define TCQ_STATES 256

// The tables (tcq-tables.h)
static const int16_t tcq3_tables[32] = { TCQ3_A(TCQ_LEVEL) TCQ3_B(TCQ_LEVEL) };
static const int16_t tcq2_tables[32] = { TCQ2_A(TCQ_LEVEL) TCQ2_B(TCQ_LEVEL) };
static const int16_t tcq25_tables[64] = { TCQ25_A3(TCQ_LEVEL) TCQ25_B3(TCQ_LEVEL) TCQ25_A2(TCQ_LEVEL) TCQ25_B2(TCQ_LEVEL) };
static const int16_t tcq35_tables[64] = { TCQ35_A4(TCQ_LEVEL) TCQ35_B4(TCQ_LEVEL) TCQ35_A3(TCQ_LEVEL) TCQ35_B3(TCQ_LEVEL) };

const int16_t * ggml_kvq_tcq_tables(enum ggml_type type, int j) {
    switch (type) {
        case GGML_TYPE_TCQ3_64: case GGML_TYPE_TCQ3_128: return tcq3_tables;
        case GGML_TYPE_TCQ2_64: case GGML_TYPE_TCQ2_128: return tcq2_tables;
        case GGML_TYPE_TCQ25_64: return tcq25_tables + 32*(j & 1);
        case GGML_TYPE_TCQ35_64: return tcq35_tables + 32*(j & 1);
        default:                return NULL;
    }
}

int ggml_kvq_tcq_bits(enum ggml_type type, int j) {
    switch (type) {
        case GGML_TYPE_TCQ3_64: case GGML_TYPE_TCQ3_128: return 3;
        case GGML_TYPE_TCQ2_64: case GGML_TYPE_TCQ2_128: return 2;
        case GGML_TYPE_TCQ25_64: return (j & 1) ? 2 : 3;
        case GGML_TYPE_TCQ35_64: return (j & 1) ? 3 : 4;
        default:                return 0;
    }
}

// a run's stream: even values take k[0] bits, odd ones k[1] (equal but for tcq25_64 / tcq35_64); t[p], lut + 256*p: the
// tables and levels of parity p
typedef struct {
    int k[2];
    const int16_t * t[2];
} tcq_code;

static tcq_code tcq_code_of(enum ggml_type type) {
    const tcq_code c = { { ggml_kvq_tcq_bits(type, 0), ggml_kvq_tcq_bits(type, 1) },
                         { ggml_kvq_tcq_tables(type, 0), ggml_kvq_tcq_tables(type, 1) } };
    return c;
}

// value j's first bit in its run's stream, and the stream's bytes for n values
static inline int tcq_pos(const int k[2], int j) {
    return (j/2)*(k[0] + k[1]) + (j & 1)*k[0];
}

static inline int tcq_stream_bytes(const int k[2], int n) {
    return n/2*(k[0] + k[1])/8;
}

static inline float tcq_level(const int16_t * t, int s) {
    return (float) (t[s >> 4] + t[16 + (s & 15)]) * (1.0f/4096);
}

// The least-squared-error path for z[0..n) (n <= 64, even) read from index rot (even) on, around the block; step
// i takes k = kk[i & 1] bits and the levels lut + 256*(i & 1): state_i = (b_i << (8 - k)) | (state_{i-1} >> k).
// o >= 0: the path must start in a state whose low 8 - kk[0] bits are o and end in one whose high 8 - kk[0] bits are
// o (tail-biting); o < 0: any start and end. Ties: the first.
// (ggml_kvq_tcq_viterbi_t: the CPU's SIMD search returns the same states.)
static void tcq_viterbi(const float * z, int n, const int kk[2], const float * lut, int o, int rot, uint8_t * st) {
    const int k0 = kk[0], ml0 = (1 << (8 - k0)) - 1;
    float cost[TCQ_STATES], minc[TCQ_STATES];
    uint8_t bp[QK_TCQ][TCQ_STATES/4];   // per step, each predecessor group's best member (2^(8-k) <= 64 groups; state s reads group s & ml)
    for (int s = 0; s < TCQ_STATES; ++s) {
        const float e = z[rot % n] - lut[s];
        cost[s] = (o < 0 || (s & ml0) == o) ? e*e : INFINITY;
    }
    for (int i = 1; i < n; ++i) {
        const int k = kk[i & 1], K = 1 << k, ml = (1 << (8 - k)) - 1;
        const float * li = lut + TCQ_STATES*(i & 1);
        for (int m = 0; m <= ml; ++m) {     // a state's predecessors are the K states m*K .. m*K + K - 1
            float b = cost[m*K];
            int bj = 0;
            for (int j = 1; j < K; ++j) {
                if (cost[m*K + j] < b) {
                    b = cost[m*K + j];
                    bj = j;
                }
            }
            minc[m] = b;
            bp[i][m] = (uint8_t) bj;
        }
        const float zi = z[(i + rot) % n];
        for (int s = 0; s < TCQ_STATES; ++s) {
            const float e = zi - li[s];
            const float e2 = e*e;
            cost[s] = minc[s & ml] + e2;
        }
    }
    int s = -1;
    float b = INFINITY;
    for (int q = 0; q < TCQ_STATES; ++q) {
        if ((o < 0 || (q >> k0) == o) && (s < 0 || cost[q] < b)) {
            b = cost[q];
            s = q;
        }
    }
    st[n - 1] = (uint8_t) s;
    for (int i = n - 1; i > 0; --i) {
        const int k = kk[i & 1];
        s = ((s << k) & 0xFF) | bp[i][s & ((1 << (8 - k)) - 1)];
        st[i - 1] = (uint8_t) s;
    }
}

// the scale code nearest d (>= 0; ties to the lower code): with the path fixed, a scale d' adds (d' - d)^2 * sum y^2
// to the block's squared error, so the nearest code is the best one
static uint8_t tcq_scale_code(double d) {
    if (!(d > 0.0)) {
        return 0;
    }
    if (d >= (double) ggml_kvq_tcq_scale(255)) {
        return 255;
    }
    int lo = 0, hi = 255;                   // scale(lo) < d <= scale(hi)
    while (hi - lo > 1) {
        const int mid = (lo + hi)/2;
        if ((double) ggml_kvq_tcq_scale((uint8_t) mid) >= d) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    return (uint8_t) (d - (double) ggml_kvq_tcq_scale((uint8_t) lo) <= (double) ggml_kvq_tcq_scale((uint8_t) hi) - d ? lo : hi);
}

int ggml_kvq_tcq_scale_bytes(enum ggml_type type) {
    return type == GGML_TYPE_TCQ3_128 || type == GGML_TYPE_TCQ2_128 ? 2 : 1;
}

size_t ggml_kvq_tcq_block_bytes(enum ggml_type type) {
    const tcq_code c = tcq_code_of(type);
    return ggml_kvq_tcq_scale_bytes(type) + ggml_kvq_tcq_block(type)/QK_TCQ*tcq_stream_bytes(c.k, QK_TCQ);
}

// one block of n values under one scale, in runs of `run` (n itself, or 64 of a tcq*_128 block): scaled to unit RMS,
// for each run a free path read from its middle names the overlap o (the high bits of the last value's state there)
// and the tail-biting path goes through o, then the least-squares scale of the paths' levels
// (stored as its code when sb is 1, as f16 when 2)
static void tcq_quantize_block(const float * x, int n, int run, const tcq_code * c, const float * lut,
                               int sb, uint8_t * d_out, uint8_t * qs, ggml_kvq_tcq_viterbi_t viterbi) {
    float v[QK_TCQ128], z[QK_TCQ128];
    double r2 = 0.0;
    for (int j = 0; j < n; ++j) {
        v[j] = isnan(x[j]) ? 0.0f : fmaxf(-FLT_MAX, fminf(FLT_MAX, x[j]));
        r2 += (double) v[j]*(double) v[j];
    }
    memset(qs, 0, n/run*tcq_stream_bytes(c->k, run));
    if (!(r2 > 0.0)) {
        memset(d_out, 0, (size_t) sb);
        return;
    }
    const float inv = (float) fmin(1.0/sqrt(r2/n), (double) FLT_MAX);
    for (int j = 0; j < n; ++j) {
        z[j] = v[j]*inv;
    }
    uint8_t st[QK_TCQ128];
    for (int r = 0; r < n; r += run) {
        viterbi(z + r, run, c->k, lut, -1, run/2, st + r);
        viterbi(z + r, run, c->k, lut, st[r + run/2 - 1] >> c->k[0], 0, st + r);
    }
    double xy = 0.0, yy = 0.0;
    for (int j = 0; j < n; ++j) {
        const float y = tcq_level(c->t[j & 1], st[j]);
        xy += (double) v[j]*(double) y;
        yy += (double) y*(double) y;
    }
    const double d = yy > 0.0 ? fmax(-65504.0, fmin(65504.0, xy/yy)) : 0.0;
    if (sb == 1) {
        d_out[0] = tcq_scale_code(d);
    } else {
        const uint16_t h = ggml_kvq_fp32_to_fp16((float) d);
        d_out[0] = (uint8_t) h;
        d_out[1] = (uint8_t) (h >> 8);
    }
    const int rb = tcq_stream_bytes(c->k, run);
    for (int j = 0; j < n; ++j) {
        const int k = c->k[j & 1], b = st[j] >> (8 - k), p = 8*rb*(j/run) + tcq_pos(c->k, j % run);
        qs[p/8] |= (uint8_t) (b << (p % 8));
        if (p % 8 + k > 8) {
            qs[p/8 + 1] |= (uint8_t) (b >> (8 - p % 8));
        }
    }
}

// one run of n values of a block whose scale is d
static void tcq_dequantize_block(const uint8_t * d, int sb, const uint8_t * qs, int n, const tcq_code * c, float * y) {
    const int nbytes = tcq_stream_bytes(c->k, n);
    uint8_t ext[QK_TCQ*4/8 + 2];            // the stream's last byte, the stream, a zero: every window in one read
    ext[0] = qs[nbytes - 1];
    memcpy(ext + 1, qs, nbytes);
    ext[nbytes + 1] = 0;
    const float dd = ggml_kvq_tcq_scale_read(d, sb);
    for (int j = 0; j < n; ++j) {
        const int p = tcq_pos(c->k, j) + c->k[j & 1];   // the window [p_j + k_j - 8, p_j + k_j) of the stream is ext's [p, p + 8)
        const int s = ((ext[p/8] | (ext[p/8 + 1] << 8)) >> (p % 8)) & 0xFF;
        y[j] = dd*tcq_level(c->t[j & 1], s);
    }
}

// the levels of both parities, lut[256*p + s]
static void tcq_lut(const tcq_code * c, float * lut) {
    for (int p = 0; p < 2; ++p) {
        for (int s = 0; s < TCQ_STATES; ++s) {
            lut[TCQ_STATES*p + s] = tcq_level(c->t[p], s);
        }
    }
}

int ggml_kvq_tcq_block(enum ggml_type type) {
    return ggml_kvq_type_qk(type);          // the type table's qk column (ggml-kvq-types.h)
}

void ggml_kvq_quantize_row_tcq_with(enum ggml_type type, const float * x, void * y, int64_t n,
                                    ggml_kvq_tcq_viterbi_t viterbi) {
    const tcq_code c = tcq_code_of(type);
    const int qk = ggml_kvq_tcq_block(type), sb = ggml_kvq_tcq_scale_bytes(type);
    const size_t bs = ggml_kvq_tcq_block_bytes(type);
    float lut[2*TCQ_STATES];
    tcq_lut(&c, lut);
    for (int64_t i = 0; i < n/qk; ++i) {
        uint8_t * b = (uint8_t *) y + i*bs;
        tcq_quantize_block(x + i*qk, qk, QK_TCQ, &c, lut, sb, b, b + sb, viterbi);
    }
}

// a row of a TCQ type's blocks: each run of 64 read with its block's scale
static void tcq_dequantize_row(enum ggml_type type, const void * x, float * y, int64_t n) {
    const tcq_code c = tcq_code_of(type);
    const int qk = ggml_kvq_tcq_block(type), sb = ggml_kvq_tcq_scale_bytes(type), rb = tcq_stream_bytes(c.k, QK_TCQ);
    const size_t bs = ggml_kvq_tcq_block_bytes(type);
    for (int64_t i = 0; i < n/qk; ++i) {
        const uint8_t * b = (const uint8_t *) x + i*bs;
        for (int r = 0; r < qk; r += QK_TCQ) {
            tcq_dequantize_block(b, sb, b + sb + r/QK_TCQ*rb, QK_TCQ, &c, y + i*qk + r);
        }
    }
}

void quantize_row_tcq3_64_ref(const float * x, block_tcq3_64 * y, int64_t k) {
    ggml_kvq_quantize_row_tcq_with(GGML_TYPE_TCQ3_64, x, y, k, tcq_viterbi);
}

void quantize_row_tcq2_64_ref(const float * x, block_tcq2_64 * y, int64_t k) {
    ggml_kvq_quantize_row_tcq_with(GGML_TYPE_TCQ2_64, x, y, k, tcq_viterbi);
}

void quantize_row_tcq3_128_ref(const float * x, block_tcq3_128 * y, int64_t k) {
    ggml_kvq_quantize_row_tcq_with(GGML_TYPE_TCQ3_128, x, y, k, tcq_viterbi);
}

void quantize_row_tcq2_128_ref(const float * x, block_tcq2_128 * y, int64_t k) {
    ggml_kvq_quantize_row_tcq_with(GGML_TYPE_TCQ2_128, x, y, k, tcq_viterbi);
}

void dequantize_row_tcq3_128(const block_tcq3_128 * x, float * y, int64_t k) {
    tcq_dequantize_row(GGML_TYPE_TCQ3_128, x, y, k);
}

void dequantize_row_tcq2_128(const block_tcq2_128 * x, float * y, int64_t k) {
    tcq_dequantize_row(GGML_TYPE_TCQ2_128, x, y, k);
}

void dequantize_row_tcq3_64(const block_tcq3_64 * x, float * y, int64_t k) {
    tcq_dequantize_row(GGML_TYPE_TCQ3_64, x, y, k);
}

void dequantize_row_tcq2_64(const block_tcq2_64 * x, float * y, int64_t k) {
    tcq_dequantize_row(GGML_TYPE_TCQ2_64, x, y, k);
}

void quantize_row_tcq25_64_ref(const float * x, block_tcq25_64 * y, int64_t k) {
    ggml_kvq_quantize_row_tcq_with(GGML_TYPE_TCQ25_64, x, y, k, tcq_viterbi);
}

void dequantize_row_tcq25_64(const block_tcq25_64 * x, float * y, int64_t k) {
    tcq_dequantize_row(GGML_TYPE_TCQ25_64, x, y, k);
}

void quantize_row_tcq35_64_ref(const float * x, block_tcq35_64 * y, int64_t k) {
    ggml_kvq_quantize_row_tcq_with(GGML_TYPE_TCQ35_64, x, y, k, tcq_viterbi);
}

void dequantize_row_tcq35_64(const block_tcq35_64 * x, float * y, int64_t k) {
    tcq_dequantize_row(GGML_TYPE_TCQ35_64, x, y, k);
}

// a trellis-coded run of n values inside another type's block (the halves of q4t2_64 and t32_64): the rule and tables
// of the TCQ type tt
void ggml_kvq_tcq_quantize_run(enum ggml_type tt, const float * x, int n, uint8_t * d, uint8_t * qs,
                               ggml_kvq_tcq_viterbi_t viterbi) {
    const tcq_code c = tcq_code_of(tt);
    float lut[2*TCQ_STATES];
    tcq_lut(&c, lut);
    tcq_quantize_block(x, n, n, &c, lut, 1, d, qs, viterbi != NULL ? viterbi : tcq_viterbi);
}

void ggml_kvq_tcq_dequantize_run(enum ggml_type tt, const uint8_t * d, const uint8_t * qs, int n, float * y) {
    const tcq_code c = tcq_code_of(tt);
    tcq_dequantize_block(d, 1, qs, n, &c, y);
}

bool ggml_kvq_validate_row_tcq(enum ggml_type type, const void * data, size_t nbytes) {
    const int sb = ggml_kvq_tcq_scale_bytes(type);
    return sb == 1 || ggml_kvq_validate_f16_scales(data, nbytes, ggml_kvq_tcq_block_bytes(type), 1);
}
