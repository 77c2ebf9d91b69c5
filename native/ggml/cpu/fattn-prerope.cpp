// CPU flash attention on a pre-RoPE key cache (fattn.h): each decoded key is turned back into the key the model
// computed (the Hadamard undone, scale and mean restored) and rotated to its cell's position.
#include "fattn.h"

#include <memory>
#include <mutex>

namespace kvq_fa {

fa_prerope fa_prerope_of(const ggml_tensor * dst) {
    fa_prerope pr;
    int mode = 0;
    if (!ggml_kvq_fa_get_prerope(dst, &pr.n_dims, &mode, &pr.mscale, &pr.n_rot_h)) {
        return pr;
    }
    pr.on    = true;
    pr.centred = ggml_kvq_fa_is_centred(dst);
    pr.h_skip = ggml_kvq_fa_get_hadamard_skip(dst);
    pr.neox  = mode == 2;
    pr.pos   = (const int32_t *) dst->src[5]->data;
    pr.pos_stride = dst->src[5]->nb[1] / sizeof(int32_t);
    pr.mean  = (const float *) dst->src[6]->data;
    pr.scale = (const float *) dst->src[7]->data;
    pr.freqs = (const float *) dst->src[8]->data;
    if (const ggml_tensor * rows = ggml_kvq_fa_get_window(dst)) {
        const size_t plane = dst->src[5]->nb[2] / sizeof(int32_t);
        pr.win      = pr.pos + plane;
        pr.win_rows = (const char *) rows->data;
        pr.win_nb1  = rows->nb[1];
        pr.win_n    = rows->ne[1];
        pr.win_v0   = dst->src[1]->ne[0]*dst->src[1]->ne[2];
        pr.win_type = rows->type;
        pr.win_to_float = fa_to_float(rows->type, false);
        GGML_ASSERT(rows->type == GGML_TYPE_F16 || rows->type == GGML_TYPE_Q8_0);
        if (dst->src[5]->ne[2] >= 4) {
            pr.win_last = pr.pos + 2*plane;
            pr.win_qpos = pr.pos + 3*plane;
        }
    }
    return pr;
}

// per channel, laid out like a row: cos(p*w)*m in both channels of a pair, -sin(p*w)*m in the first, +sin in the second
void fa_rope_fill(const fa_prerope & pr, const float * w, int32_t p, float m, float * c, float * s) {
    for (int i = 0; i < pr.n_dims/2; ++i) {
        const float th = (float) p*w[i];
        const float ci = cosf(th)*m, si = sinf(th)*m;
        int a, b;
        fa_rope_pair(pr, i, &a, &b);
        c[a] = ci; s[a] = -si;
        c[b] = ci; s[b] =  si;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// the three butterfly stages within 8 lanes (h = 1, 2, 4): lane j becomes v[j]*sign + v[j ^ h]
inline __m256 fa_fwht8(__m256 v) {
    const __m256 sg1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 sg2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 sg4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    v = _mm256_fmadd_ps(v, sg1, _mm256_permute_ps(v, 0xB1));
    v = _mm256_fmadd_ps(v, sg2, _mm256_permute_ps(v, 0x4E));
    return _mm256_fmadd_ps(v, sg4, _mm256_permute2f128_ps(v, v, 1));
}
#endif

// unnormalized Walsh-Hadamard transform (Sylvester order) of each block of n values of x[0, DK),
// without the butterfly at stride skip (0: every stride).
// The butterfly stages commute, so the three in-register stages (h = 1, 2, 4) run first.
void fa_fwht(float * x, int64_t DK, int n, int skip) {
#if defined(__AVX2__) && defined(__FMA__)
    if (n % 8 == 0 && (skip == 0 || skip >= 8)) {
        for (int64_t d = 0; d < DK; d += 8) {
            _mm256_storeu_ps(x + d, fa_fwht8(_mm256_loadu_ps(x + d)));
        }
        for (int64_t b = 0; b < DK; b += n) {
            float * y = x + b;
            for (int h = 8; h < n; h *= 2) {
                if (h == skip) {
                    continue;
                }
                for (int i = 0; i < n; i += 2*h) {
                    for (int j = i; j < i + h; j += 8) {
                        const __m256 a = _mm256_loadu_ps(y + j), c = _mm256_loadu_ps(y + j + h);
                        _mm256_storeu_ps(y + j,     _mm256_add_ps(a, c));
                        _mm256_storeu_ps(y + j + h, _mm256_sub_ps(a, c));
                    }
                }
            }
        }
        return;
    }
#endif
    for (int64_t b = 0; b < DK; b += n) {
        float * y = x + b;
        for (int h = 1; h < n; h *= 2) {
            if (h == skip) {
                continue;
            }
            for (int i = 0; i < n; i += 2*h) {
                for (int j = i; j < i + h; ++j) {
                    const float a = y[j], c = y[j + h];
                    y[j]     = a + c;
                    y[j + h] = a - c;
                }
            }
        }
    }
}

// scalar: the rotary channels of one row become R·(x*sc + mu), with cos/sin laid out like the row (fa_rope_fill)
inline void fa_restore_rotate(const fa_prerope & pr, float * x, const float * sc, const float * mu, const float * c,
                              const float * s) {
    for (int k = 0; k < pr.n_dims; ++k) {
        x[k] = x[k]*sc[k] + mu[k];
    }
    for (int i = 0; i < pr.n_dims/2; ++i) {
        int a, b;
        fa_rope_pair(pr, i, &a, &b);
        const float xa = x[a], xb = x[b];
        x[a] = xa*c[a] + xb*s[a];
        x[b] = xb*c[b] + xa*s[b];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// 8 channels of cos/sin advanced by one step of the rotation (c1, s1 = cos(w), ±sin(w)), stored back
inline void fa_rope_step8(float * c, float * s, const float * c1, const float * s1, __m256 & cv, __m256 & sv) {
    const __m256 c1v = _mm256_loadu_ps(c1), s1v = _mm256_loadu_ps(s1);
    const __m256 cn = _mm256_fmsub_ps(cv, c1v, _mm256_mul_ps(sv, s1v));
    sv = _mm256_fmadd_ps(sv, c1v, _mm256_mul_ps(cv, s1v));
    cv = cn;
    _mm256_storeu_ps(c, cv);
    _mm256_storeu_ps(s, sv);
}
#endif

// cos/sin per channel (laid out like a row, fa_rope_fill) advanced by one step of the rotation c1, s1
inline void fa_rope_advance(const fa_prerope & pr, float * c, float * s, const float * c1, const float * s1) {
    int k = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (pr.n_dims % 16 == 0) {
        for (; k < pr.n_dims; k += 8) {
            __m256 cv = _mm256_loadu_ps(c + k), sv = _mm256_loadu_ps(s + k);
            fa_rope_step8(c + k, s + k, c1 + k, s1 + k, cv, sv);
        }
    }
#endif
    for (; k < pr.n_dims; ++k) {
        const float ck = c[k];
        c[k] = ck*c1[k] - s[k]*s1[k];
        s[k] = s[k]*c1[k] + ck*s1[k];
    }
}

// one row: x*sc + mu, its rotary channels turned by the cos/sin arrays c, s (laid out like the row)
inline void fa_restore_rotate_row(const fa_prerope & pr, float * x, int64_t DK, const float * sc, const float * mu,
                                  const float * c, const float * s) {
    const int nd = pr.n_dims, hd = nd/2;
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (nd % 16 == 0) {
        if (pr.neox) {
            for (; j < hd; j += 8) {
                const int jb = j + hd;
                const __m256 xa = _mm256_fmadd_ps(_mm256_loadu_ps(x + j),  _mm256_loadu_ps(sc + j),  _mm256_loadu_ps(mu + j));
                const __m256 xb = _mm256_fmadd_ps(_mm256_loadu_ps(x + jb), _mm256_loadu_ps(sc + jb), _mm256_loadu_ps(mu + jb));
                _mm256_storeu_ps(x + j,  _mm256_fmadd_ps(xa, _mm256_loadu_ps(c + j),  _mm256_mul_ps(xb, _mm256_loadu_ps(s + j))));
                _mm256_storeu_ps(x + jb, _mm256_fmadd_ps(xb, _mm256_loadu_ps(c + jb), _mm256_mul_ps(xa, _mm256_loadu_ps(s + jb))));
            }
        } else {
            for (; j < nd; j += 8) {
                const __m256 xa = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(sc + j), _mm256_loadu_ps(mu + j));
                _mm256_storeu_ps(x + j, _mm256_fmadd_ps(xa, _mm256_loadu_ps(c + j),
                                                        _mm256_mul_ps(_mm256_permute_ps(xa, 0xB1), _mm256_loadu_ps(s + j))));
            }
        }
        j = nd;
    }
#endif
    if (j == 0) {
        fa_restore_rotate(pr, x, sc, mu, c, s);
    }
    for (int64_t d = nd; d < DK; ++d) {      // partial rotary: the rest is not rotated
        x[d] = x[d]*sc[d] + mu[d];
    }
}

// k rows of the tile: undo the Hadamard, restore scale and mean, rotate at positions pos[0..n).
// sc: this head's scale times fa_hadamard_norm (the transform runs unnormalized).
void fa_prerope_tile(const fa_prerope & pr, int64_t ik2, int64_t DK, const int32_t * pos, int64_t n, float * Kf,
                     float * cs, const float * c1, const float * s1, const float * sc) {
    const float * mu = pr.mean  + ik2*DK;
    const float * w  = pr.freqs + ik2*(pr.n_dims/2);
    float * c = cs;              // [n_dims] cos(p*w)*mscale per channel
    float * s = cs + pr.n_dims;  // [n_dims] ±sin(p*w)*mscale
    for (int64_t t = 0; t < n; ++t) {
        if (t > 0 && pos[t] == pos[t - 1] + 1) {
            fa_rope_advance(pr, c, s, c1, s1);
        } else {     // exactly: a tile's first key, or after a jump in positions
            fa_rope_fill(pr, w, pos[t], pr.mscale, c, s);
        }
        float * x = Kf + t*DK;
        if (pr.n_rot_h) {
            fa_fwht(x, DK, pr.n_rot_h, pr.h_skip);
        }
        fa_restore_rotate_row(pr, x, DK, sc, mu, c, s);
    }
}

namespace {

// tab for these frequencies: cos/sin of t*w per channel for the FA_TILE_KV offsets of a tile
void fa_rope_tab_fill(fa_rope_tab & tab, const fa_prerope & pr, const float * w, int64_t DK) {
    const int hd = pr.n_dims/2;
    tab.w.assign(w, w + hd);
    tab.mscale = pr.mscale;
    tab.n_dims = pr.n_dims;
    tab.neox = pr.neox;
    tab.DK = DK;
    tab.c.assign(FA_TILE_KV*DK, 1.0f);      // channels past n_dims: not rotated
    tab.s.assign(FA_TILE_KV*DK, 0.0f);
    tab.c64.resize(hd);
    tab.s64.resize(hd);
    for (int i = 0; i < hd; ++i) {
        int a, b;
        fa_rope_pair(pr, i, &a, &b);
        const double c1 = cos((double) w[i]), s1 = sin((double) w[i]);
        double ct = 1.0, st = 0.0;           // R(t), advanced in double: exact to float over a tile
        for (int t = 0; t < FA_TILE_KV; ++t) {
            float * c = tab.c.data() + t*DK, * s = tab.s.data() + t*DK;
            c[a] = (float) (ct*pr.mscale); s[a] = (float) (-st*pr.mscale);
            c[b] = (float) (ct*pr.mscale); s[b] = (float) ( st*pr.mscale);
            const double cn = ct*c1 - st*s1;
            st = st*c1 + ct*s1;
            ct = cn;
        }
        tab.c64[i] = ct;
        tab.s64[i] = st;
    }
}

bool fa_rope_tab_is(const fa_rope_tab & tab, const fa_prerope & pr, const float * w, int64_t DK) {
    return tab.n_dims == pr.n_dims && tab.neox == pr.neox && tab.mscale == pr.mscale && tab.DK == DK &&
           std::equal(w, w + pr.n_dims/2, tab.w.begin());
}

}  // namespace

// One table per head's frequencies, shared by every thread and kept (a table is immutable once built): with per-head
// frequencies (K-sort) consecutive work items are different heads, and a per-thread table of one entry was rebuilt
// for nearly every item (2% of a SmolLM2 decode at 4096 cells in perf, its cos/sin beside it). Found by where the
// frequencies lie (a model's tensor: the same address every token) and checked against their values. At most
// FA_ROPE_TABS_BYTES in all (a 7B model's 256 heads of 128 take 16 MiB); past that, a thread's own table as before.
const fa_rope_tab & fa_rope_tab_for(const fa_prerope & pr, const float * w, int64_t DK) {
    constexpr size_t FA_ROPE_TABS_BYTES = 64u << 20;
    thread_local const fa_rope_tab * last = nullptr;
    if (last != nullptr && fa_rope_tab_is(*last, pr, w, DK)) {
        return *last;
    }
    static std::mutex mu;
    static std::unordered_multimap<const float *, std::unique_ptr<fa_rope_tab>> tabs;
    static size_t bytes = 0;
    auto find = [&]() -> const fa_rope_tab * {
        auto r = tabs.equal_range(w);
        for (auto it = r.first; it != r.second; ++it) {
            if (fa_rope_tab_is(*it->second, pr, w, DK)) {
                return it->second.get();
            }
        }
        return nullptr;
    };
    {
        std::lock_guard<std::mutex> lock(mu);
        if ((last = find()) != nullptr) {
            return *last;
        }
    }
    auto tab = std::make_unique<fa_rope_tab>();
    fa_rope_tab_fill(*tab, pr, w, DK);           // outside the lock: another thread may build the same one meanwhile
    const size_t size = (tab->c.size() + tab->s.size())*sizeof(float);
    {
        std::lock_guard<std::mutex> lock(mu);
        if ((last = find()) != nullptr) {
            return *last;
        }
        if (bytes + size <= FA_ROPE_TABS_BYTES) {
            bytes += size;
            last = tab.get();
            tabs.emplace(w, std::move(tab));
            return *last;
        }
    }
    thread_local fa_rope_tab own;
    own = std::move(*tab);
    last = &own;
    return own;
}

// cos/sin(p w) of the pairs 0..n-1 exactly. Each work item's first tile needs them, and the same tile starts and
// frequencies come back in every head, layer and token, so each thread keeps the last ones it computed (direct
// mapped by tile and all the frequencies: with per-head frequencies a decode cycles through every head's, 90 on
// SmolLM2 times the chunks' starts, which 64 slots keyed by one frequency thrashed; the values are those cos/sin
// give, so results do not depend on the memo).
void fa_rope_exact(int32_t p, int n, const float * w, double * c, double * s) {
    struct slot {
        int32_t p = INT32_MIN;
        std::vector<float> w;
        std::vector<double> c, s;
    };
    constexpr uint32_t N_SLOTS = 1024;          // ~0.7 KiB each for 32 pairs
    thread_local std::vector<slot> memo;        // on the heap: a dlopened library has little static TLS
    if (memo.empty()) {
        memo.resize(N_SLOTS);
    }
    uint32_t h = 2166136261u ^ (uint32_t) p;    // FNV-1a of the position and the frequencies' bits
    for (int j = 0; j < n; ++j) {
        uint32_t b;
        memcpy(&b, w + j, sizeof(b));
        h = (h ^ b)*16777619u;
    }
    slot & e = memo[(h ^ (h >> 16)) % N_SLOTS];
    if (e.p == p && e.w.size() == (size_t) n && std::equal(w, w + n, e.w.begin())) {
        std::copy(e.c.begin(), e.c.end(), c);
        std::copy(e.s.begin(), e.s.end(), s);
        return;
    }
    for (int j = 0; j < n; ++j) {
        const double th = (double) p*w[j];
        c[j] = cos(th);
        s[j] = sin(th);
    }
    e.p = p;
    e.w.assign(w, w + n);
    e.c.assign(c, c + n);
    e.s.assign(s, s + n);
}


// rows Qr = R(p0)ᵀ Q for the R query rows, given cos/sin of p0*w per pair
void fa_rope_q_back(const fa_prerope & pr, const double * cp, const double * sp, const float * Q, int64_t R, int64_t DK, float * Qr) {
    memcpy(Qr, Q, R*DK*sizeof(float));
    for (int64_t r = 0; r < R; ++r) {
        const float * q = Q + r*DK;
        float * y = Qr + r*DK;
        for (int i = 0; i < pr.n_dims/2; ++i) {
            int a, b;
            fa_rope_pair(pr, i, &a, &b);
            const float c = (float) cp[i], s = (float) sp[i];
            y[a] = q[a]*c + q[b]*s;
            y[b] = q[b]*c - q[a]*s;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// a transformed row's end (8 lanes): x*sc + mu, its pairs turned by the cos/sin rows c, s (laid out like the row), stored
template <int NV>
inline void fa_restore_turn8(bool neox, __m256 * v, const float * sc, const float * mu, const float * c,
                             const float * s, float * x) {
    #pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
        v[i] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(sc + 8*i), _mm256_loadu_ps(mu + 8*i));
    }
    if (neox) {
        #pragma GCC unroll 16
        for (int i = 0; i < NV/2; ++i) {
            const int ib = i + NV/2;
            const __m256 a = v[i], b = v[ib];
            v[i]  = _mm256_fmadd_ps(a, _mm256_loadu_ps(c + 8*i),  _mm256_mul_ps(b, _mm256_loadu_ps(s + 8*i)));
            v[ib] = _mm256_fmadd_ps(b, _mm256_loadu_ps(c + 8*ib), _mm256_mul_ps(a, _mm256_loadu_ps(s + 8*ib)));
        }
    } else {
        #pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) {
            v[i] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(c + 8*i), _mm256_mul_ps(_mm256_permute_ps(v[i], 0xB1), _mm256_loadu_ps(s + 8*i)));
        }
    }
    #pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
        _mm256_storeu_ps(x + 8*i, v[i]);
    }
}

// fa_prerope_tile_rel with each row held in registers through the transform, scale, mean and
// rotation (head sizes 64 and 128, full rotary, Hadamard blocks of 8 .. DK). NVH (the Hadamard
// block in vectors, 0: none) and SKV (the left-out butterfly stride in vectors, 0: none) are template
// arguments so that every index into v[] is a constant.
template <int NV, int NVH, int SKV = 0>
void fa_prerope_rows(const fa_prerope & pr, int64_t ik2, float * Kf, int64_t n, const float * sc, const fa_rope_tab & tab) {
    constexpr int DK = 8*NV;
    const float * mu = pr.mean + ik2*DK;
    for (int64_t t = 0; t < n; ++t) {
        float * x = Kf + t*DK;
        const float * c = tab.c.data() + t*DK, * s = tab.s.data() + t*DK;
        __m256 v[NV];
        #pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) {
            v[i] = _mm256_loadu_ps(x + 8*i);
        }
        if (NVH) {
            #pragma GCC unroll 16
            for (int i = 0; i < NV; ++i) {
                v[i] = fa_fwht8(v[i]);
            }
            #pragma GCC unroll 16
            for (int h = 1; h < NVH; h *= 2) {
                if (h == SKV) {
                    continue;
                }
                #pragma GCC unroll 16
                for (int i = 0; i < NV; i += 2*h) {
                    #pragma GCC unroll 16
                    for (int j = i; j < i + h; ++j) {
                        const __m256 a = v[j], b = v[j + h];
                        v[j]     = _mm256_add_ps(a, b);
                        v[j + h] = _mm256_sub_ps(a, b);
                    }
                }
            }
        }
        fa_restore_turn8<NV>(pr.neox, v, sc, mu, c, s, x);
    }
}

#if defined(__F16C__)
// fa_prerope_rows fused with the q4_0 row decoder, as fa_prerope_q4_0_rows16 (which says why the bits are the same):
// each block is one register of 32 int8 values for the butterflies of strides 1 .. 8 (_mm256_sign_epi8 flips the
// lanes that take partner - x), stride 16 in float before the block's scale, the rest after it.
template <int NV, int HB>
void fa_prerope_q4_0_rows(const fa_prerope & pr, int64_t ik2, const char * k0, size_t nb1, float * Kf, int64_t n,
                          const float * sc, const fa_rope_tab & tab) {
    constexpr int DK = 8*NV;
    const float * mu = pr.mean + ik2*DK;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i c8 = _mm256_set1_epi8(8);
    // per stride h: partner j ^ h within each 16-byte lane, and -1 on the lanes with j & h
    const __m256i p1 = _mm256_setr_epi8(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14,
                                        1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    const __m256i p2 = _mm256_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13,
                                        2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const __m256i p4 = _mm256_setr_epi8(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11,
                                        4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    const __m256i p8 = _mm256_setr_epi8(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7,
                                        8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i s1 = _mm256_set1_epi16((short) 0xFF01);                 // bytes 1, -1, 1, -1, ...
    const __m256i s2 = _mm256_set1_epi32((int) 0xFFFF0101);
    const __m256i s4 = _mm256_set1_epi64x((long long) 0xFFFFFFFF01010101ull);
    const __m256i s8 = _mm256_setr_epi64x(0x0101010101010101ll, -1ll, 0x0101010101010101ll, -1ll);
    for (int64_t t = 0; t < n; ++t) {
        const block_q4_0 * b = (const block_q4_0 *) (k0 + t*nb1);
        float * x = Kf + t*DK;
        const float * c = tab.c.data() + t*DK, * s = tab.s.data() + t*DK;
        __m256 v[NV];
        #pragma GCC unroll 4
        for (int k = 0; k < NV/4; ++k) {
            const __m128i q = _mm_loadu_si128((const __m128i *) b[k].qs);
            const __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
            __m256i z = _mm256_sub_epi8(_mm256_set_m128i(hi, lo), c8);       // values 0..31 in order
            if (HB > 1) { z = _mm256_add_epi8(_mm256_shuffle_epi8(z, p1), _mm256_sign_epi8(z, s1)); }
            if (HB > 2) { z = _mm256_add_epi8(_mm256_shuffle_epi8(z, p2), _mm256_sign_epi8(z, s2)); }
            if (HB > 4) { z = _mm256_add_epi8(_mm256_shuffle_epi8(z, p4), _mm256_sign_epi8(z, s4)); }
            if (HB > 8) { z = _mm256_add_epi8(_mm256_shuffle_epi8(z, p8), _mm256_sign_epi8(z, s8)); }
            const __m128i zl = _mm256_castsi256_si128(z), zh = _mm256_extracti128_si256(z, 1);
            __m256 * w = v + 4*k;
            w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(zl));
            w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(zl, zl)));
            w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(zh));
            w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(zh, zh)));
            if (HB > 16) {
                const __m256 a0 = w[0], a1 = w[1];
                w[0] = _mm256_add_ps(a0, w[2]); w[2] = _mm256_sub_ps(a0, w[2]);
                w[1] = _mm256_add_ps(a1, w[3]); w[3] = _mm256_sub_ps(a1, w[3]);
            }
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(b[k].d));
            #pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
                w[i] = _mm256_mul_ps(w[i], d);
            }
        }
        #pragma GCC unroll 16
        for (int h = 4; 8*h < HB; h *= 2) {
            #pragma GCC unroll 16
            for (int i = 0; i < NV; i += 2*h) {
                #pragma GCC unroll 16
                for (int j = i; j < i + h; ++j) {
                    const __m256 a = v[j], e = v[j + h];
                    v[j]     = _mm256_add_ps(a, e);
                    v[j + h] = _mm256_sub_ps(a, e);
                }
            }
        }
        fa_restore_turn8<NV>(pr.neox, v, sc, mu, c, s, x);
    }
}
#endif
#endif

#if defined(__AVX512F__)
// GCC 12 takes the undefined pass-through of its AVX-512 permute intrinsics for an uninitialized read (GCC bug 105593)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// one butterfly stage of stride H < 16 within 16 lanes: lane j becomes v[j]*sign + v[j ^ H]
template <int H>
inline __m512 fa_fwht16_stage(__m512 v) {
    constexpr __mmask16 neg = H == 1 ? 0xAAAA : H == 2 ? 0xCCCC : H == 4 ? 0xF0F0 : 0xFF00;   // lanes with j & H
    const __m512 sg = _mm512_mask_blend_ps(neg, _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f));
    __m512 partner;
    if constexpr (H == 1) {
        partner = _mm512_permute_ps(v, 0xB1);
    } else if constexpr (H == 2) {
        partner = _mm512_permute_ps(v, 0x4E);
    } else if constexpr (H == 4) {
        partner = _mm512_shuffle_f32x4(v, v, 0xB1);
    } else {
        partner = _mm512_shuffle_f32x4(v, v, 0x4E);
    }
    return _mm512_fmadd_ps(v, sg, partner);
}

// the butterfly stages of strides 16*H0 .. HB/2 between registers (a row in NV registers of 16), but SKIP
template <int NV, int HB, int SKIP, int H0 = 1>
inline void fa_fwht16_between(__m512 * v) {
    #pragma GCC unroll 16
    for (int h = H0; 16*h < HB; h *= 2) {
        if (16*h == SKIP) {
            continue;
        }
        #pragma GCC unroll 16
        for (int i = 0; i < NV; i += 2*h) {
            #pragma GCC unroll 16
            for (int j = i; j < i + h; ++j) {
                const __m512 a = v[j], b = v[j + h];
                v[j]     = _mm512_add_ps(a, b);
                v[j + h] = _mm512_sub_ps(a, b);
            }
        }
    }
}

// a transformed row's end: x*sc + mu, its pairs turned by the cos/sin rows c, s (laid out like the row), stored
template <int NV>
inline void fa_restore_turn16(bool neox, __m512 * v, const __m512 * vsc, const __m512 * vmu, const float * c,
                              const float * s, float * x) {
    #pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
        v[i] = _mm512_fmadd_ps(v[i], vsc[i], vmu[i]);
    }
    if (neox) {
        #pragma GCC unroll 16
        for (int i = 0; i < NV/2; ++i) {
            const int ib = i + NV/2;
            const __m512 a = v[i], b = v[ib];
            v[i]  = _mm512_fmadd_ps(a, _mm512_loadu_ps(c + 16*i),  _mm512_mul_ps(b, _mm512_loadu_ps(s + 16*i)));
            v[ib] = _mm512_fmadd_ps(b, _mm512_loadu_ps(c + 16*ib), _mm512_mul_ps(a, _mm512_loadu_ps(s + 16*ib)));
        }
    } else {
        #pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) {
            v[i] = _mm512_fmadd_ps(v[i], _mm512_loadu_ps(c + 16*i),
                                   _mm512_mul_ps(_mm512_permute_ps(v[i], 0xB1), _mm512_loadu_ps(s + 16*i)));
        }
    }
    #pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
        _mm512_storeu_ps(x + 16*i, v[i]);
    }
}

// fa_prerope_rows in 16 lanes: a 64-wide row is 4 registers, so the transform takes half the instructions, and the
// head's scale and mean stay in registers over the tile. The same butterflies in the same order (a multiply by
// +-1 in an FMA is exact): the same bits as the 8-lane version. HB: the Hadamard block in values (0: none),
// SKIP: the left-out butterfly stride in values (0: none, else >= 16).
template <int NV, int HB, int SKIP = 0>
void fa_prerope_rows16(const fa_prerope & pr, int64_t ik2, float * Kf, int64_t n, const float * sc, const fa_rope_tab & tab) {
    static_assert(SKIP == 0 || SKIP >= 16, "strides below a register are always applied");
    constexpr int DK = 16*NV;
    const float * mu = pr.mean + ik2*DK;
    __m512 vsc[NV], vmu[NV];
    #pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
        vsc[i] = _mm512_loadu_ps(sc + 16*i);
        vmu[i] = _mm512_loadu_ps(mu + 16*i);
    }
    for (int64_t t = 0; t < n; ++t) {
        float * x = Kf + t*DK;
        const float * c = tab.c.data() + t*DK, * s = tab.s.data() + t*DK;
        __m512 v[NV];
        #pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) {
            v[i] = _mm512_loadu_ps(x + 16*i);
            if (HB > 1) { v[i] = fa_fwht16_stage<1>(v[i]); }
            if (HB > 2) { v[i] = fa_fwht16_stage<2>(v[i]); }
            if (HB > 4) { v[i] = fa_fwht16_stage<4>(v[i]); }
            if (HB > 8) { v[i] = fa_fwht16_stage<8>(v[i]); }
        }
        fa_fwht16_between<NV, HB, SKIP>(v);
        fa_restore_turn16<NV>(pr.neox, v, vsc, vmu, c, s, x);
    }
}

#if defined(__AVX512BW__) && defined(__F16C__)
// one butterfly stage of stride H < 16 on 64 int8 values (16-byte lanes): byte j becomes partner - x where j & H,
// x + partner elsewhere (fa_fwht16_stage's signs)
template <int H>
inline __m512i fa_fwht_i8_stage(__m512i x) {
    constexpr __mmask64 neg = H == 1 ? 0xAAAAAAAAAAAAAAAAull : H == 2 ? 0xCCCCCCCCCCCCCCCCull
                            : H == 4 ? 0xF0F0F0F0F0F0F0F0ull : 0xFF00FF00FF00FF00ull;
    alignas(64) static const struct idx_t {
        int8_t b[64];
        constexpr idx_t() : b() {
            for (int j = 0; j < 64; ++j) {
                b[j] = (int8_t) ((j & 15) ^ H);
            }
        }
    } idx;
    const __m512i p = _mm512_shuffle_epi8(x, _mm512_load_si512(idx.b));
    return _mm512_mask_sub_epi8(_mm512_add_epi8(x, p), neg, p, x);
}

// fa_prerope_rows16 fused with the q4_0 row decoder: a consecutive tile's keys straight from the cache. Each pair
// of blocks (64 values) is one register of int8 for the butterflies of strides 1 .. 8 (sums of 16 values in
// [-8, 7] stay in [-128, 120]); stride 16 runs in float before the blocks' scales, the rest after them. Every sum
// is exact up to stride 16 (d has 11 significant bits, the integers at most 9), and from there on the same
// operations take the same values as the decoder followed by fa_prerope_rows16: the same bits, in about 3/4 of the
// instructions (no per-lane sign multiplies, no float stores and reloads of the decoded row).
template <int NV, int HB>
void fa_prerope_q4_0_rows16(const fa_prerope & pr, int64_t ik2, const char * k0, size_t nb1, float * Kf, int64_t n,
                            const float * sc, const fa_rope_tab & tab) {
    constexpr int DK = 16*NV;
    const float * mu = pr.mean + ik2*DK;
    __m512 vsc[NV], vmu[NV];
    #pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
        vsc[i] = _mm512_loadu_ps(sc + 16*i);
        vmu[i] = _mm512_loadu_ps(mu + 16*i);
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m512i c8 = _mm512_set1_epi8(8);
    for (int64_t t = 0; t < n; ++t) {
        const block_q4_0 * b = (const block_q4_0 *) (k0 + t*nb1);
        float * x = Kf + t*DK;
        const float * c = tab.c.data() + t*DK, * s = tab.s.data() + t*DK;
        __m512 v[NV];
        #pragma GCC unroll 4
        for (int g = 0; g < NV/4; ++g) {
            const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) b[2*g].qs)),
                                                      _mm_loadu_si128((const __m128i *) b[2*g + 1].qs), 1);
            const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            // [lo0 lo1 hi0 hi1] -> [lo0 hi0 lo1 hi1]: values 0..63 in order
            __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            z = _mm512_sub_epi8(_mm512_shuffle_i64x2(z, z, 0xD8), c8);
            if (HB > 1) { z = fa_fwht_i8_stage<1>(z); }
            if (HB > 2) { z = fa_fwht_i8_stage<2>(z); }
            if (HB > 4) { z = fa_fwht_i8_stage<4>(z); }
            if (HB > 8) { z = fa_fwht_i8_stage<8>(z); }
            __m512 * w = v + 4*g;
            w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(z)));
            w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(z, 1)));
            w[2] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(z, 2)));
            w[3] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(z, 3)));
            if (HB > 16) {
                const __m512 a0 = w[0], a2 = w[2];
                w[0] = _mm512_add_ps(a0, w[1]); w[1] = _mm512_sub_ps(a0, w[1]);
                w[2] = _mm512_add_ps(a2, w[3]); w[3] = _mm512_sub_ps(a2, w[3]);
            }
            const __m512 d0 = _mm512_set1_ps(_cvtsh_ss(b[2*g].d)), d1 = _mm512_set1_ps(_cvtsh_ss(b[2*g + 1].d));
            w[0] = _mm512_mul_ps(w[0], d0); w[1] = _mm512_mul_ps(w[1], d0);
            w[2] = _mm512_mul_ps(w[2], d1); w[3] = _mm512_mul_ps(w[3], d1);
        }
        fa_fwht16_between<NV, HB, 0, 2>(v);
        fa_restore_turn16<NV>(pr.neox, v, vsc, vmu, c, s, x);
    }
}
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // __AVX512F__

namespace {

// fa_prerope_rows for this head size and layout, or false
bool fa_prerope_rows_any(const fa_prerope & pr, int64_t ik2, int64_t DK, float * Kf, int64_t n, const float * sc,
                         const fa_rope_tab & tab) {
#if defined(__AVX512F__)
    if (pr.n_dims == DK && (DK == 64 || DK == 128)) {
        using fn = void (*)(const fa_prerope &, int64_t, float *, int64_t, const float *, const fa_rope_tab &);
        // by head size, then Hadamard block: none, 8, 16, 32, 64, 128 (a block no larger than the head)
        static const fn t64[]  = { fa_prerope_rows16<4, 0>, fa_prerope_rows16<4, 8>,  fa_prerope_rows16<4, 16>,
                                   fa_prerope_rows16<4, 32>, fa_prerope_rows16<4, 64> };
        static const fn t128[] = { fa_prerope_rows16<8, 0>, fa_prerope_rows16<8, 8>,  fa_prerope_rows16<8, 16>,
                                   fa_prerope_rows16<8, 32>, fa_prerope_rows16<8, 64>, fa_prerope_rows16<8, 128> };
        fn f = nullptr;
        const int b = pr.n_rot_h == 0 ? 0 : pr.n_rot_h >= 8 && pr.n_rot_h <= DK && (pr.n_rot_h & (pr.n_rot_h - 1)) == 0
                    ? __builtin_ctz(pr.n_rot_h) - 2 : -1;     // 8 -> 1, 16 -> 2, ...
        if (pr.h_skip == 0 && b >= 0) {
            f = DK == 64 ? t64[b] : t128[b];
        } else if (DK == 128 && pr.n_rot_h == 128 && pr.h_skip == 32) {
            f = fa_prerope_rows16<8, 128, 32>;    // q53_64 keys on a 128 head (llama_kvq_new_k_rot)
        }
        if (f) {
            f(pr, ik2, Kf, n, sc, tab);
            return true;
        }
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (pr.n_dims == DK) {
        using fn = void (*)(const fa_prerope &, int64_t, float *, int64_t, const float *, const fa_rope_tab &);
        fn f = nullptr;
        // by head size, then Hadamard block: none, 8, 16, 32, 64, 128 (a block no larger than the head)
        static const fn t64[]  = { fa_prerope_rows<8, 0>,  fa_prerope_rows<8, 1>,  fa_prerope_rows<8, 2>,
                                   fa_prerope_rows<8, 4>,  fa_prerope_rows<8, 8> };
        static const fn t128[] = { fa_prerope_rows<16, 0>, fa_prerope_rows<16, 1>, fa_prerope_rows<16, 2>,
                                   fa_prerope_rows<16, 4>, fa_prerope_rows<16, 8>, fa_prerope_rows<16, 16> };
        int i = -1;
        for (int b = 0, n = 0; n <= DK; n = n ? 2*n : 8, ++b) {
            if (pr.n_rot_h == n) {
                i = b;
                break;
            }
        }
        if (pr.h_skip == 0) {
            f = i < 0 ? nullptr : DK == 64 ? t64[i] : DK == 128 ? t128[i] : nullptr;
        } else if (DK == 128 && pr.n_rot_h == 128 && pr.h_skip == 32) {
            f = fa_prerope_rows<16, 16, 4>;    // q53_64 keys on a 128 head (llama_kvq_new_k_rot)
        }
        if (f) {
            f(pr, ik2, Kf, n, sc, tab);
            return true;
        }
    }
#endif
    GGML_UNUSED(pr); GGML_UNUSED(ik2); GGML_UNUSED(DK); GGML_UNUSED(Kf); GGML_UNUSED(n); GGML_UNUSED(sc);
    GGML_UNUSED(tab);
    return false;
}

}  // namespace

// the fused q4_0 rows for this build's widest registers, by head size DK and Hadamard block HB
#if defined(__AVX512BW__) && defined(__F16C__)
#define FA_Q4_0_FUSED 1
template <int DK, int HB>
void fa_q4_0_rows_fused(const fa_prerope & pr, int64_t ik2, const char * k0, size_t nb1, float * Kf, int64_t n,
                        const float * sc, const fa_rope_tab & tab) {
    fa_prerope_q4_0_rows16<DK/16, HB>(pr, ik2, k0, nb1, Kf, n, sc, tab);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FA_Q4_0_FUSED 1
template <int DK, int HB>
void fa_q4_0_rows_fused(const fa_prerope & pr, int64_t ik2, const char * k0, size_t nb1, float * Kf, int64_t n,
                        const float * sc, const fa_rope_tab & tab) {
    fa_prerope_q4_0_rows<DK/8, HB>(pr, ik2, k0, nb1, Kf, n, sc, tab);
}
#endif

bool fa_prerope_tile_rel_q4_0(const fa_prerope & pr, int64_t ik2, int64_t DK, const char * k0, size_t nb1, int64_t n,
                              float * Kf, const float * sc, const fa_rope_tab & tab) {
#if defined(FA_Q4_0_FUSED)
    if (pr.n_dims == DK && (DK == 64 || DK == 128) && pr.h_skip == 0) {
        using fn = void (*)(const fa_prerope &, int64_t, const char *, size_t, float *, int64_t, const float *,
                            const fa_rope_tab &);
        fn f = nullptr;
        switch (pr.n_rot_h) {       // the Hadamard block: none, 8 .. the head
            case 0:   f = DK == 64 ? fa_q4_0_rows_fused<64, 0>  : fa_q4_0_rows_fused<128, 0>;  break;
            case 8:   f = DK == 64 ? fa_q4_0_rows_fused<64, 8>  : fa_q4_0_rows_fused<128, 8>;  break;
            case 16:  f = DK == 64 ? fa_q4_0_rows_fused<64, 16> : fa_q4_0_rows_fused<128, 16>; break;
            case 32:  f = DK == 64 ? fa_q4_0_rows_fused<64, 32> : fa_q4_0_rows_fused<128, 32>; break;
            case 64:  f = DK == 64 ? fa_q4_0_rows_fused<64, 64> : fa_q4_0_rows_fused<128, 64>; break;
            case 128: f = DK == 128 ? fa_q4_0_rows_fused<128, 128> : nullptr; break;
            default: break;
        }
        if (f) {
            f(pr, ik2, k0, nb1, Kf, n, sc, tab);
            return true;
        }
    }
#endif
    GGML_UNUSED(pr); GGML_UNUSED(ik2); GGML_UNUSED(DK); GGML_UNUSED(k0); GGML_UNUSED(nb1); GGML_UNUSED(n);
    GGML_UNUSED(Kf); GGML_UNUSED(sc); GGML_UNUSED(tab);
    return false;
}

// k rows of a consecutive tile: undo the Hadamard, restore scale and mean, turn row t by R(t)
void fa_prerope_tile_rel(const fa_prerope & pr, int64_t ik2, int64_t DK, int64_t n, float * Kf, const float * sc,
                         const fa_rope_tab & tab) {
    if (fa_prerope_rows_any(pr, ik2, DK, Kf, n, sc, tab)) {
        return;
    }
    const float * mu = pr.mean + ik2*DK;
    for (int64_t t = 0; t < n; ++t) {
        float * x = Kf + t*DK;
        if (pr.n_rot_h) {
            fa_fwht(x, DK, pr.n_rot_h, pr.h_skip);
        }
        fa_restore_rotate_row(pr, x, DK, sc, mu, tab.c.data() + t*DK, tab.s.data() + t*DK);
    }
}

}  // namespace kvq_fa
