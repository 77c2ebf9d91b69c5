// CPU flash attention on a centred post-RoPE key cache (fattn.h): the mean's scores, q·R(p)mean per key.
#include "fattn.h"

namespace kvq_fa {
namespace {

constexpr double FA_CENTRED_TOL = 1e-6;     // |cos|, |sin| <= 1: the float table itself is good to 6e-8

void fa_centred_head_build(fa_centred_head & h, const int * pair, const float * w, int np) {
    h.pair.assign(pair, pair + np);
    h.w.assign(w, w + np);
    h.tab.resize(2*np*FA_TILE_KV);
    h.c64.resize(np);
    h.s64.resize(np);
    std::vector<double> res(2*np*FA_TILE_KV);    // T in double, then what the basis leaves of it
    for (int j = 0; j < np; ++j) {
        const double c1 = cos((double) w[j]), s1 = sin((double) w[j]);
        double ct = 1.0, st = 0.0;
        for (int t = 0; t < FA_TILE_KV; ++t) {
            res[j*FA_TILE_KV + t]        = ct;
            res[(np + j)*FA_TILE_KV + t] = st;
            h.tab[j*FA_TILE_KV + t]        = (float) ct;
            h.tab[(np + j)*FA_TILE_KV + t] = (float) st;
            const double cn = ct*c1 - st*s1;
            st = st*c1 + ct*s1;
            ct = cn;
        }
        h.c64[j] = ct;
        h.s64[j] = st;
    }
    const int m = 2*np;
    std::vector<double> B, P(m*FA_TILE_KV, 0.0);
    int r = 0;
    for (; r < FA_TILE_KV; ++r) {
        int best = -1;
        double best_n2 = 0.0, worst = 0.0;
        for (int i = 0; i < m; ++i) {
            double n2 = 0.0;
            for (int t = 0; t < FA_TILE_KV; ++t) {
                n2 += res[i*FA_TILE_KV + t]*res[i*FA_TILE_KV + t];
                worst = std::max(worst, fabs(res[i*FA_TILE_KV + t]));
            }
            if (n2 > best_n2) {
                best_n2 = n2;
                best = i;
            }
        }
        if (worst <= FA_CENTRED_TOL) {
            break;
        }
        const double inv = 1.0/sqrt(best_n2);
        B.resize((r + 1)*FA_TILE_KV);
        double * q = B.data() + r*FA_TILE_KV;
        for (int t = 0; t < FA_TILE_KV; ++t) {
            q[t] = res[best*FA_TILE_KV + t]*inv;
        }
        for (int i = 0; i < m; ++i) {
            double d = 0.0;
            for (int t = 0; t < FA_TILE_KV; ++t) {
                d += res[i*FA_TILE_KV + t]*q[t];
            }
            P[i*FA_TILE_KV + r] = d;
            for (int t = 0; t < FA_TILE_KV; ++t) {
                res[i*FA_TILE_KV + t] -= d*q[t];
            }
        }
    }
    const int rp = (r + 7)/8*8;
    // per row and tile: 2 np x rp to gather the coefficients, r x FA_TILE_KV to score; the table: 2 np x FA_TILE_KV
    if (r > 0 && rp*m + r*FA_TILE_KV >= m*FA_TILE_KV) {
        r = 0;
    }
    h.r = r;
    h.rp = r ? rp : 0;
    if (r) {
        std::vector<float>().swap(h.tab);      // the low-rank form replaces it (other tiles use exact cos/sin)
    }
    h.B.assign(B.begin(), B.begin() + r*FA_TILE_KV);
    h.P.assign(m*h.rp, 0.0f);
    for (int i = 0; i < m && r; ++i) {
        for (int k = 0; k < r; ++k) {
            h.P[i*h.rp + k] = (float) P[i*FA_TILE_KV + k];
        }
    }
}

// this thread's fa_centred_head for the pairs (pair, w): the KV heads of every layer, each built once
const fa_centred_head & fa_centred_head_for(const int * pair, const float * w, int np) {
    thread_local std::unordered_map<uint64_t, fa_centred_head> heads;
    uint64_t key = 1469598103934665603ull ^ (uint64_t) np;
    for (int j = 0; j < np; ++j) {
        uint32_t wb;
        memcpy(&wb, w + j, sizeof(wb));
        key = (key ^ (uint64_t) pair[j]) * 1099511628211ull;
        key = (key ^ wb) * 1099511628211ull;
    }
    auto it = heads.find(key);
    if (it != heads.end() && it->second.pair.size() == (size_t) np &&
        std::equal(pair, pair + np, it->second.pair.begin()) && std::equal(w, w + np, it->second.w.begin())) {
        return it->second;
    }
    if (heads.size() >= 4096) {     // a bound for processes that load many models
        heads.clear();
    }
    fa_centred_head & h = heads[key];
    fa_centred_head_build(h, pair, w, np);
    return h;
}

}  // namespace

void fa_centred_setup(const fa_prerope & pr, int64_t ik2, int64_t DK, const float * Q, int64_t R, float * qtmp,
                      float * coef, fa_centred & c) {
    const float * mu = pr.mean + ik2*DK;
    const float * w  = pr.freqs + ik2*(pr.n_dims/2);
    c.np = 0;
    c.anchor = fa_tile_anchor();
    c.c0.resize(pr.n_dims/2);
    c.s0.resize(pr.n_dims/2);
    c.pair.resize(pr.n_dims/2);
    c.w.resize(pr.n_dims/2);
    c.cc.resize(pr.n_dims/2);
    c.ss.resize(pr.n_dims/2);
    c.g.resize(std::max(pr.n_dims, FA_TILE_KV));
    c.ab.resize(pr.n_dims);
    for (int i = 0; i < pr.n_dims/2; ++i) {
        int a, b;
        fa_rope_pair(pr, i, &a, &b);
        if (mu[a] != 0.0f || mu[b] != 0.0f) {
            c.w[c.np] = w[i];
            c.pair[c.np++] = i;
        }
    }
    const int np = c.np;
    const float hs = fa_hadamard_norm(pr);
    for (int64_t r = 0; r < R; ++r) {
        const float * q = Q + r*DK;
        if (pr.n_rot_h) {
            for (int64_t d = 0; d < DK; ++d) {
                qtmp[d] = q[d]*hs;
            }
            fa_fwht(qtmp, DK, pr.n_rot_h, pr.h_skip);
            q = qtmp;
        }
        float * al = coef + r*2*np, * be = al + np;
        for (int j = 0; j < np; ++j) {
            int a, b;
            fa_rope_pair(pr, c.pair[j], &a, &b);
            const float ma = mu[a]*pr.mscale, mb = mu[b]*pr.mscale;
            al[j] = q[a]*ma + q[b]*mb;
            be[j] = q[b]*ma - q[a]*mb;
        }
    }
    c.head = np ? &fa_centred_head_for(c.pair.data(), c.w.data(), np) : nullptr;
}

// g[0..rp) = sum over i < m of ab[i] P[i][0..rp): 8 weights per pass, held in registers through every pair
inline void fa_centred_weights(const float * GGML_RESTRICT ab, const float * GGML_RESTRICT P, int m, int rp,
                               float * GGML_RESTRICT g) {
#if defined(__AVX2__) && defined(__FMA__)
    for (int k = 0; k < rp; k += 8) {
        __m256 x = _mm256_setzero_ps(), y = _mm256_setzero_ps();    // two chains: half the FMA latency
        int i = 0;
        for (; i + 1 < m; i += 2) {
            x = _mm256_fmadd_ps(_mm256_set1_ps(ab[i]),     _mm256_loadu_ps(P + i*rp + k),       x);
            y = _mm256_fmadd_ps(_mm256_set1_ps(ab[i + 1]), _mm256_loadu_ps(P + (i + 1)*rp + k), y);
        }
        if (i < m) {
            x = _mm256_fmadd_ps(_mm256_set1_ps(ab[i]), _mm256_loadu_ps(P + i*rp + k), x);
        }
        _mm256_storeu_ps(g + k, _mm256_add_ps(x, y));
    }
#else
    for (int k = 0; k < rp; ++k) {
        float x = 0.0f;
        for (int i = 0; i < m; ++i) {
            x += ab[i]*P[i*rp + k];
        }
        g[k] = x;
    }
#endif
}

// S (R x n) += each row's mean scores for the tile's keys at positions pos[0..n)
void fa_centred_bias(fa_centred & c, const int32_t * pos, int64_t R, int64_t n, const float * coef, float * exact,
                     float * S) {
    const int np = c.np;
    if (np == 0) {
        return;
    }
    const fa_centred_head & h = *c.head;
    const float * T = h.tab.data();
    float * cc = c.cc.data(), * ss = c.ss.data();
    const bool rel = fa_consecutive(pos, n);
    if (rel) {
        c.anchor.at(pos[0], np, c.w.data(), h.c64.data(), h.s64.data(), c.c0.data(), c.s0.data());
        for (int j = 0; j < np; ++j) {
            cc[j] = (float) c.c0[j];
            ss[j] = (float) c.s0[j];
        }
    } else {
        for (int j = 0; j < np; ++j) {
            for (int64_t t = 0; t < n; ++t) {
                const double th = (double) pos[t]*c.w[j];
                exact[j*FA_TILE_KV + t]        = (float) cos(th);
                exact[(np + j)*FA_TILE_KV + t] = (float) sin(th);
            }
        }
        T = exact;
        c.anchor.p0 = INT32_MIN;
    }
    // the low-rank form: rows of B instead of T's, each weighted by g = the turned coefficients times P
    const bool low = rel && h.r > 0;
    const int nb = low ? h.r : 2*np;
    float * g = c.g.data();
    for (int64_t r = 0; r < R; ++r) {
        const float * al = coef + r*2*np, * be = al + np;
        float * GGML_RESTRICT sr = S + r*n;
        const float * rows = T;
        if (low) {
            // al cos(p0 w + t w) + be sin(p0 w + t w) = (al c0 + be s0) cos(t w) + (be c0 - al s0) sin(t w)
            float * GGML_RESTRICT ab = c.ab.data();
            for (int j = 0; j < np; ++j) {
                ab[j]      = al[j]*cc[j] + be[j]*ss[j];
                ab[np + j] = be[j]*cc[j] - al[j]*ss[j];
            }
            fa_centred_weights(ab, h.P.data(), 2*np, h.rp, g);
            rows = h.B.data();
        } else {
            for (int j = 0; j < np; ++j) {
                g[j]      = rel ? al[j]*cc[j] + be[j]*ss[j] : al[j];
                g[np + j] = rel ? be[j]*cc[j] - al[j]*ss[j] : be[j];
            }
        }
#if defined(__AVX2__) && defined(__FMA__)
        if (n == FA_TILE_KV) {      // a whole tile: the row's 64 scores stay in registers through every basis row
            __m256 acc[FA_TILE_KV/8];
            #pragma GCC unroll 8
            for (int i = 0; i < FA_TILE_KV/8; ++i) {
                acc[i] = _mm256_loadu_ps(sr + 8*i);
            }
            for (int k = 0; k < nb; ++k) {
                const __m256 a = _mm256_set1_ps(g[k]);
                const float * bk = rows + k*FA_TILE_KV;
                #pragma GCC unroll 8
                for (int i = 0; i < FA_TILE_KV/8; ++i) {
                    acc[i] = _mm256_fmadd_ps(a, _mm256_loadu_ps(bk + 8*i), acc[i]);
                }
            }
            #pragma GCC unroll 8
            for (int i = 0; i < FA_TILE_KV/8; ++i) {
                _mm256_storeu_ps(sr + 8*i, acc[i]);
            }
            continue;
        }
#endif
        for (int k = 0; k < nb; ++k) {
            const float gk = g[k];
            const float * GGML_RESTRICT bk = rows + k*FA_TILE_KV;
            for (int64_t t = 0; t < n; ++t) {
                sr[t] += gk*bk[t];
            }
        }
    }
}

}  // namespace kvq_fa
