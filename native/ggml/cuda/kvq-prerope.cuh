// pykvq: the read path of a pre-RoPE K cache (ggml-kvq.h, "Pre-RoPE key cache") on CUDA.
//
// A warp holds one decoded K row, lane l the D/32 consecutive channels l*EPL .. l*EPL+EPL-1
// (the decode kernel's layout). kvq_prerope_row turns it into the post-RoPE key attention uses:
// inverse Walsh-Hadamard per block of n_rot_h channels (in-lane butterflies below EPL, xor
// shuffles above; the one at stride h_skip left out for keys split in halves, q53_64 / q42_64),
// k = c*scale + mean, and ggml_rope_ext's rotation at the cell's own position (angle pos*w in float
// as upstream's rope kernel computes it, sin/cos per pair). NORM pairs are in-lane; NEOX pairs
// (i, i + n_dims/2) are one shuffle apart when n_dims/2 is a multiple of EPL, the only NEOX layout
// these kernels take (kvq_prerope_fits). A centred post-RoPE K (--kv-domain centred) takes the same
// pieces the other way round: the cached row plus the mean rotated at the cell's position and then
// turned by H, since K and Q were both turned by H. Used by the decode kernel once per K row for the
// whole GQA group and by the prefill path's K -> f16 conversion (kvq-rows.cuh).
#pragma once

#include "kvq-codec.cuh"

struct kvq_prerope_args {
    const int32_t * pos;        // [n_stream][pos_stride]: each cell's position
    const float   * mean;       // [n_head_kv][D]
    const float   * scale;      // [n_head_kv][D]
    const float   * freqs;      // [n_head_kv][n_dims/2]: angular frequency of each pair
    int64_t pos_stride;         // elements between the streams' position rows
    int     n_dims;             // rotated channels (partial rotary: < D)
    int     neox;               // 0: NORM, 1: NEOX
    int     n_rot_h;            // 0: no Hadamard, else its size (a power of two dividing D)
    int     h_skip;             // a butterfly stride the Hadamard leaves out (0: none; ggml_kvq_fa_set_hadamard_skip)
    float   h_norm;             // the orthonormal Hadamard's factor: 1/sqrt(n_rot_h), 1/sqrt(n_rot_h/2) with a skip
    float   mscale;             // multiplies cos and sin
    int     centred;            // 1: a centred post-RoPE K (ggml_kvq_fa_set_centred): the cache holds H R(p)(k - mean)
};

// true when the kernels below compute this layout (else the op is declined: the CPU runs it)
static inline bool kvq_prerope_fits(int D, int n_dims, bool neox, int n_rot_h, int h_skip) {
    if (!(D == 64 || D == 128 || D == 256) || n_dims <= 0 || n_dims > D || n_dims % 2 != 0) {
        return false;
    }
    if (n_rot_h != 0 && (n_rot_h < 2 || n_rot_h > D || (n_rot_h & (n_rot_h - 1)) != 0)) {
        return false;
    }
    if (h_skip != 0 && (n_rot_h == 0 || h_skip < 1 || h_skip >= n_rot_h || (h_skip & (h_skip - 1)) != 0)) {
        return false;
    }
    return !neox || (n_dims/2) % (D/32) == 0;
}

// sin and cos of a = pos*w: reduced by 2*pi in two parts first, so that the fast sincos
// (-use_fast_math) stays accurate at large positions
static __device__ __forceinline__ void kvq_prerope_sincos(const float a, float * s, float * c) {
    const float k = rintf(a*0.159154943091895336f);
    float r = fmaf(-k, 6.28318548202514648f, a);    // 2*pi rounded to float ...
    r = fmaf(-k, -1.74845553146951715e-7f, r);      // ... and what that rounding left out
    sincosf(r, s, c);
}

// a lane's constants for one KV head, loaded once
template <int EPL>
struct kvq_prerope_lane {
    float mean[EPL], scale[EPL], w[EPL];   // w: the frequency of the pair each channel is in
    int   c0;                              // first channel of the lane
    int   partner;                         // NEOX: the lane with the other halves of this lane's pairs
    bool  first;                           // NEOX: this lane holds first halves
};

template <int EPL>
static __device__ __forceinline__ void kvq_prerope_lane_init(kvq_prerope_lane<EPL> & L, const kvq_prerope_args & p,
                                                             int kvh, int D, int lane) {
    const int half = p.n_dims/2;
    L.c0 = lane*EPL;
    L.first   = L.c0 < half;
    L.partner = !p.neox || L.c0 >= p.n_dims ? lane : L.first ? lane + half/EPL : lane - half/EPL;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
        const int c = L.c0 + e;
        L.mean[e]  = p.mean [(int64_t) kvh*D + c];
        L.scale[e] = p.scale[(int64_t) kvh*D + c];
        const int i = p.neox ? (L.first ? c : c - half) : c/2;
        L.w[e] = c < p.n_dims ? p.freqs[(int64_t) kvh*half + i] : 0.0f;
    }
}

// the inverse Walsh-Hadamard of a warp-held row (H is its own inverse: the butterflies of the fast transform,
// Sylvester order, the one at stride h_skip left out), normalized. Every lane must call it (shuffles).
template <int EPL>
static __device__ __forceinline__ void kvq_prerope_hadamard(float (&x)[EPL], const kvq_prerope_args & p) {
    const int lane = threadIdx.x;
#pragma unroll
    for (int s = 1; s < EPL; s <<= 1) {
        if (s < p.n_rot_h && s != p.h_skip) {
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
                if (!(e & s)) {
                    const float a = x[e], b = x[e + s];
                    x[e]     = a + b;
                    x[e + s] = a - b;
                }
            }
        }
    }
    for (int m = 1; m*EPL < p.n_rot_h; m <<= 1) {
        if (m*EPL == p.h_skip) {
            continue;
        }
        const bool hi = lane & m;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            const float o = __shfl_xor_sync(0xFFFFFFFF, x[e], m, WARP_SIZE);
            x[e] = hi ? o - x[e] : x[e] + o;
        }
    }
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
        x[e] *= p.h_norm;
    }
}

// ggml_rope_ext's rotation of a warp-held row at position pos (cos and sin times mscale; channels from n_dims on
// unchanged). Every lane must call it (NEOX: shuffles).
template <int EPL>
static __device__ __forceinline__ void kvq_prerope_rotate(float (&x)[EPL], const int pos, const kvq_prerope_lane<EPL> & L,
                                                          const kvq_prerope_args & p) {
    const float fp = (float) pos;
    if (!p.neox) {
#pragma unroll
        for (int e = 0; e < EPL; e += 2) {
            if (L.c0 + e < p.n_dims) {
                float s, c;
                kvq_prerope_sincos(fp*L.w[e], &s, &c);
                s *= p.mscale;
                c *= p.mscale;
                const float x0 = x[e], x1 = x[e + 1];
                x[e]     = x0*c - x1*s;
                x[e + 1] = x0*s + x1*c;
            }
        }
    } else {
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            const float o = __shfl_sync(0xFFFFFFFF, x[e], L.partner, WARP_SIZE);
            if (L.c0 < p.n_dims) {
                float s, c;
                kvq_prerope_sincos(fp*L.w[e], &s, &c);
                x[e] = L.first ? x[e]*c*p.mscale - o*s*p.mscale : o*s*p.mscale + x[e]*c*p.mscale;
            }
        }
    }
}

// x: the lane's EPL values of one cached row -> the key attention reads at position pos: pre-RoPE, the post-RoPE key
// (inverse Hadamard, c*scale + mean, rotation); centred, the cached H R(p)(k - mean) plus H R(p) mean (Q is H q).
// Every lane of the warp must call it (shuffles).
template <int EPL>
static __device__ __forceinline__ void kvq_prerope_row(float (&x)[EPL], const int pos, const kvq_prerope_lane<EPL> & L,
                                                       const kvq_prerope_args & p) {
    if (p.centred) {
        float m[EPL];   // the rotary pairs' mean only, as the CPU kernel reads it (ggml-kvq.h)
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            m[e] = L.c0 + e < p.n_dims ? L.mean[e] : 0.0f;
        }
        kvq_prerope_rotate<EPL>(m, pos, L, p);
        if (p.n_rot_h) {
            kvq_prerope_hadamard<EPL>(m, p);
        }
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
            x[e] += m[e];
        }
        return;
    }
    if (p.n_rot_h) {
        kvq_prerope_hadamard<EPL>(x, p);
    }
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
        x[e] = x[e]*L.scale[e] + L.mean[e];
    }
    kvq_prerope_rotate<EPL>(x, pos, L, p);
}
