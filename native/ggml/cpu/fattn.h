// CPU flash attention on pykvq's caches: what fattn.cpp (work plan, the item loop, the entry points) shares with
// fattn-rows.cpp (row decoders), fattn-prerope.cpp (pre-RoPE keys: Hadamard, scale, mean, RoPE per key) and
// fattn-centred.cpp (centred post-RoPE keys: the mean's scores). Internal to ggml-cpu.
#pragma once

#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"     // block_q8_0, block_q4_0
#include "ggml-kvq-cpu.h"

#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#include "simd-gemm.h"
#include "vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <vector>

namespace kvq_fa {

constexpr int FA_TILE_KV = 64;   // keys per tile: K and V tiles of 64 x 128 f32 stay in L2

// ---- row decoders (fattn-rows.cpp) ----------------------------------------------------------------------

// row decoder for a cache type; K rows of nuq types use the K codebook (slot A)
ggml_to_float_t fa_to_float(ggml_type type, bool is_k);
// Q row -> K's vec_dot_type -> f32 (FA_MATCH only); f32/f16 K: Q as f16, as upstream
void fa_round_q(ggml_type k_type, float * x, int64_t n, void * tmp);

// ---- pre-RoPE keys (fattn-prerope.cpp) ------------------------------------------------------------------

// Pre-RoPE K cache (ggml-kvq.h): a decoded tile holds c = (k - mean)/scale before RoPE.
// Each row becomes k = c*scale + mean, rotated at its cell's position. cos/sin come per
// channel from arrays laid out like the row (a pair's two channels hold cos, and -sin / +sin),
// advanced from one key to the next by the rotation of angle w when the cells' positions are
// consecutive (the common case), recomputed exactly at a tile's start and after any jump.
struct fa_prerope {
    bool on = false;
    bool centred = false;            // K is H R(p)(k - mean): post-RoPE, plus q·R(p)mean per score (fa_centred)
    int  n_dims = 0;
    bool neox = false;
    float mscale = 1.0f;
    int  n_rot_h = 0;                // Walsh-Hadamard block (0: none)
    int  h_skip = 0;                 // a butterfly stride the Hadamard leaves out (0: none; ggml_kvq_fa_set_hadamard_skip)
    const int32_t * pos = nullptr;   // src[5]
    int64_t pos_stride = 0;          // per stream
    const float * mean = nullptr, * scale = nullptr, * freqs = nullptr;
    // exact window (ggml_kvq_fa_set_window): each cell's row of src[9] (-1: the quantized cell), per stream as pos
    const int32_t * win = nullptr;
    const char * win_rows = nullptr;
    size_t  win_nb1 = 0;
    int64_t win_n   = 0;             // rows of src[9]
    int64_t win_v0  = 0;             // where V starts in a row (elements)
    ggml_type win_type = GGML_TYPE_F16;      // rows in f16 or q8_0
    ggml_to_float_t win_to_float = nullptr;  // their row decoder (fa_to_float)
    // per query (planes 2 and 3; nullptr: every query reads every row): the last query position that reads each
    // cell's row, and each query's position
    const int32_t * win_last = nullptr;
    const int32_t * win_qpos = nullptr;
};


fa_prerope fa_prerope_of(const ggml_tensor * dst);

// the two channels of rotary pair i: NORM (2i, 2i+1), NEOX (i, i + n_dims/2)
inline void fa_rope_pair(const fa_prerope & pr, int i, int * a, int * b) {
    *a = pr.neox ? i : 2*i;
    *b = pr.neox ? i + pr.n_dims/2 : 2*i + 1;
}


// the tile's cells hold positions pos[0], pos[0]+1, ..., pos[0]+n-1
inline bool fa_consecutive(const int32_t * pos, int64_t n) {
    int32_t off = 0;        // no early exit: the compiler vectorizes the loop (it runs once per tile)
    for (int64_t t = 1; t < n; ++t) {
        off |= pos[t] ^ (pos[0] + (int32_t) t);
    }
    return off == 0;
}

// the orthonormal Hadamard's factor: 1/sqrt of the number of values each output mixes
inline float fa_hadamard_norm(const fa_prerope & pr) {
    return pr.n_rot_h ? 1.0f/sqrtf((float) (pr.h_skip ? pr.n_rot_h/2 : pr.n_rot_h)) : 1.0f;
}

// unnormalized Walsh-Hadamard transform (Sylvester order) of each block of n values of x[0, DK),
// without the butterfly at stride skip (0: every stride)
void fa_fwht(float * x, int64_t DK, int n, int skip);

// per channel, laid out like a row: cos(p*w)*m in both channels of a pair, -sin(p*w)*m in the first, +sin in the second
void fa_rope_fill(const fa_prerope & pr, const float * w, int32_t p, float m, float * c, float * s);

// k rows of the tile: undo the Hadamard, restore scale and mean, rotate at positions pos[0..n).
// sc: this head's scale times fa_hadamard_norm (the transform runs unnormalized).
void fa_prerope_tile(const fa_prerope & pr, int64_t ik2, int64_t DK, const int32_t * pos, int64_t n, float * Kf,
                     float * cs, const float * c1, const float * s1, const float * sc);

// Decode (few query rows) over a tile whose cells hold consecutive positions p0, p0+1, ...:
// q·R(p0 + t)k = (R(p0)ᵀq)·(R(t)k). The query rows turn by -p0 once per tile and each key by its
// offset t only, read from a table of R(t)·mscale for t < FA_TILE_KV that depends on the head's
// frequencies alone, so it is built once per thread and head, not per tile (no cos/sin per key).
struct fa_rope_tab {
    std::vector<float> w;            // what it was built from: the frequencies, mscale, n_dims, mode, DK
    float mscale = 0.0f;
    int n_dims = -1;
    bool neox = false;
    int64_t DK = -1;
    std::vector<float> c, s;         // [FA_TILE_KV][DK] laid out like fa_rope_fill's arrays
    std::vector<double> c64, s64;    // [n_dims/2] the turn of one whole tile, R(FA_TILE_KV)
};


const fa_rope_tab & fa_rope_tab_for(const fa_prerope & pr, const float * w, int64_t DK);

// cos/sin(p0 w) per pair of a tile starting at position p0: exactly, or the previous tile's turned by one
// tile (c64, s64: cos/sin(FA_TILE_KV w)) when p0 follows it, re-anchored exactly every FA_ANCHOR_STEPS tiles
// (the double recurrence drifts by ~1e-16 a step; cos/sin of every pair every 16 tiles cost 4% of decode).
constexpr int FA_ANCHOR_STEPS = 256;
// cos/sin(p w) of the pairs 0..n-1 exactly (kept per thread: the same tile starts recur)
void fa_rope_exact(int32_t p, int n, const float * w, double * c, double * s);

struct fa_tile_anchor {
    int32_t p0 = INT32_MIN;
    int steps = 0;

    void at(int32_t p, int n, const float * w, const double * c64, const double * s64,
            double * c, double * s) {
        if (p0 != INT32_MIN && p == p0 + FA_TILE_KV && steps < FA_ANCHOR_STEPS) {
            for (int j = 0; j < n; ++j) {
                const double cn = c[j]*c64[j] - s[j]*s64[j];
                s[j] = s[j]*c64[j] + c[j]*s64[j];
                c[j] = cn;
            }
            ++steps;
        } else {
            fa_rope_exact(p, n, w, c, s);
            steps = 0;
        }
        p0 = p;
    }
};

// rows Qr = R(p0)ᵀ Q for the R query rows, given cos/sin of p0*w per pair
void fa_rope_q_back(const fa_prerope & pr, const double * cp, const double * sp, const float * Q, int64_t R, int64_t DK, float * Qr);

// k rows of a consecutive tile: undo the Hadamard, restore scale and mean, turn row t by R(t)
void fa_prerope_tile_rel(const fa_prerope & pr, int64_t ik2, int64_t DK, int64_t n, float * Kf, const float * sc,
                         const fa_rope_tab & tab);

// fa_prerope_tile_rel on q4_0 keys read straight from the cache (row t at k0 + t*nb1) into Kf, the same bits as
// decoding them first; false (nothing done) where this build or the head's layout has no such path
bool fa_prerope_tile_rel_q4_0(const fa_prerope & pr, int64_t ik2, int64_t DK, const char * k0, size_t nb1, int64_t n,
                              float * Kf, const float * sc, const fa_rope_tab & tab);

// ---- centred post-RoPE keys (fattn-centred.cpp) ---------------------------------------------------------

// Centred post-RoPE K: the score of row r and a key at position p gains
//   q_r·R(p)m = sum over pairs j with a mean of  al_rj cos(p w_j) + be_rj sin(p w_j),
//   al = q_a m_a + q_b m_b, be = q_b m_a - q_a m_b (q unrotated: H q turned back; m times mscale).
// For a tile of consecutive positions p0 + t the coefficients turn by p0 once per tile and the
// cos/sin of t come from a per-head table T; other tiles take exact cos/sin per key.

// What depends only on a head's kept pairs and their frequencies, built once per thread and head: the
// relative table T [2 np][FA_TILE_KV] (cos, sin of t w_j), one tile's turn, and T's low-rank form
// T ~ P B: B holds r orthonormal rows over the tile's offsets, P [2 np][rp] (pivoted Gram-Schmidt, stopped
// when no entry of T - P B exceeds FA_CENTRED_TOL). Slow pairs hardly change over 64 offsets and fast
// ones share directions, so r is about 8.5 per head where 2 np is 18 (SmolLM2) or 27 (Qwen2.5): a tile's
// mean scores then cost r FMAs per key and row (after 2 np x rp per row and tile) instead of 2 np.
struct fa_centred_head {
    std::vector<int> pair;
    std::vector<float> w;
    std::vector<float> tab;          // T (kept only without the low-rank form)
    std::vector<double> c64, s64;    // [np] cos/sin(FA_TILE_KV w): the turn of one tile
    int r = 0, rp = 0;               // rank of the low-rank form (0: T itself is cheaper), r rounded up to 8
    std::vector<float> B, P;         // [r][FA_TILE_KV], [2 np][rp]
};


struct fa_centred {
    int np = 0;                      // pairs with a non-zero mean in this head
    std::vector<int> pair;
    std::vector<float> w;            // their frequencies
    std::vector<double> c0, s0;      // cos/sin(p0 w) of the current tile (anchor)
    fa_tile_anchor anchor;
    std::vector<float> cc, ss;       // c0, s0 in float
    std::vector<float> g;            // one row's weights of the table's (or B's) rows
    std::vector<float> ab;           // one row's coefficients turned by the tile's position
    const fa_centred_head * head = nullptr;
};


// coefficients of every row (coef: [R][2 np]) and this head's table (c.head)
void fa_centred_setup(const fa_prerope & pr, int64_t ik2, int64_t DK, const float * Q, int64_t R, float * qtmp,
                      float * coef, fa_centred & c);

// S (R x n) += each row's mean scores for the tile's keys at positions pos[0..n)
void fa_centred_bias(fa_centred & c, const int32_t * pos, int64_t R, int64_t n, const float * coef, float * exact,
                     float * S);

}  // namespace kvq_fa
