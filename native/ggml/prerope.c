// Pre-RoPE key cache: the FLASH_ATTN_EXT contract (ggml-kvq.h) and the rotary
// frequencies a kernel needs to apply ggml_rope_ext's rotation at any position.
#include "ggml-kvq.h"

#include <math.h>
#include <string.h>

// log2 of a power of two
static int kvq_log2(int n) {
    int lg = 0;
    while ((1 << lg) < n) {
        ++lg;
    }
    return lg;
}

// the node's pre-RoPE tag word (op_params[GGML_KVQ_PREROPE_TAG])
static int32_t kvq_tag(const struct ggml_tensor * fa) {
    int32_t tag;
    memcpy(&tag, fa->op_params + GGML_KVQ_PREROPE_TAG, sizeof(tag));
    return tag;
}

static void kvq_set_tag(struct ggml_tensor * fa, int32_t tag) {
    memcpy(fa->op_params + GGML_KVQ_PREROPE_TAG, &tag, sizeof(tag));
}

void ggml_kvq_fa_set_prerope(struct ggml_tensor * fa, struct ggml_tensor * pos, struct ggml_tensor * mean,
                             struct ggml_tensor * scale, struct ggml_tensor * freqs,
                             int n_dims, int mode, float mscale, int n_rot_h) {
    GGML_ASSERT(fa->op == GGML_OP_FLASH_ATTN_EXT);
    GGML_ASSERT(pos->type == GGML_TYPE_I32 && mean->type == GGML_TYPE_F32 && scale->type == GGML_TYPE_F32 &&
                freqs->type == GGML_TYPE_F32);
    const struct ggml_tensor * k = fa->src[1];          // [DK, n_kv, n_head_kv, n_stream]
    GGML_ASSERT(mean->ne[0] == k->ne[0] && mean->ne[1] == k->ne[2] && ggml_are_same_shape(mean, scale));
    GGML_ASSERT(ggml_is_contiguous(mean) && ggml_is_contiguous(scale) && ggml_is_contiguous(freqs));
    GGML_ASSERT(n_dims > 0 && n_dims % 2 == 0 && n_dims <= k->ne[0] && n_dims < 4096);
    GGML_ASSERT(freqs->ne[0] == n_dims/2 && freqs->ne[1] == k->ne[2]);
    GGML_ASSERT(pos->ne[0] >= k->ne[1] && pos->ne[1] == k->ne[3]);
    GGML_ASSERT(mode == 0 || mode == 2);  // NORM, NEOX
    int lg = 0;
    if (n_rot_h > 0) {
        GGML_ASSERT((n_rot_h & (n_rot_h - 1)) == 0 && n_rot_h >= 2 && k->ne[0] % n_rot_h == 0);
        lg = kvq_log2(n_rot_h);
    }
    fa->src[5] = pos;
    fa->src[6] = mean;
    fa->src[7] = scale;
    fa->src[8] = freqs;
    kvq_set_tag(fa, GGML_KVQ_PREROPE_MAGIC | (lg << 20) | (mode << 16) | n_dims);
    memcpy(fa->op_params + GGML_KVQ_PREROPE_TAG + 1, &mscale, sizeof(mscale));
}

void ggml_kvq_fa_set_centred(struct ggml_tensor * fa, struct ggml_tensor * pos, struct ggml_tensor * mean,
                             struct ggml_tensor * freqs, int n_dims, int mode, float mscale, int n_rot_h) {
    ggml_kvq_fa_set_prerope(fa, pos, mean, mean, freqs, n_dims, mode, mscale, n_rot_h);
    kvq_set_tag(fa, kvq_tag(fa) | GGML_KVQ_PREROPE_CENTRED);
}

void ggml_kvq_fa_set_window(struct ggml_tensor * fa, struct ggml_tensor * rows) {
    GGML_ASSERT(ggml_kvq_fa_get_prerope(fa, NULL, NULL, NULL, NULL) && !ggml_kvq_fa_is_centred(fa));
    const struct ggml_tensor * k = fa->src[1], * v = fa->src[2], * pos = fa->src[5];
    GGML_ASSERT((rows->type == GGML_TYPE_F16 || rows->type == GGML_TYPE_Q8_0) && rows->ne[0] == k->ne[0]*k->ne[2] + v->ne[0]*v->ne[2]);
    GGML_ASSERT(rows->nb[0] == ggml_type_size(rows->type) && ggml_nrows(rows) == rows->ne[1]);
    // q8_0 rows: every head's K and V starts on a block (the CPU's kernels dequantize whole blocks)
    GGML_ASSERT(rows->type != GGML_TYPE_Q8_0 || (k->ne[0] % 32 == 0 && v->ne[0] % 32 == 0));
    GGML_ASSERT((pos->ne[2] == 2 || pos->ne[2] == 4) && pos->ne[3] == 1);
    fa->src[9] = rows;
}

const struct ggml_tensor * ggml_kvq_fa_get_window(const struct ggml_tensor * fa) {
    return ggml_kvq_fa_get_prerope(fa, NULL, NULL, NULL, NULL) ? fa->src[9] : NULL;
}

bool ggml_kvq_fa_is_centred(const struct ggml_tensor * fa) {
    if (!ggml_kvq_fa_get_prerope(fa, NULL, NULL, NULL, NULL)) {
        return false;
    }
    return (kvq_tag(fa) & GGML_KVQ_PREROPE_CENTRED) != 0;
}

void ggml_kvq_fa_set_hadamard_skip(struct ggml_tensor * fa, int stride) {
    int n_rot_h = 0;
    GGML_ASSERT(ggml_kvq_fa_get_prerope(fa, NULL, NULL, NULL, &n_rot_h));
    GGML_ASSERT(stride == 0 || (stride > 0 && stride < n_rot_h && (stride & (stride - 1)) == 0));
    const int f = stride ? 1 + kvq_log2(stride) : 0;   /* in 3 bits: strides up to 64 */
    GGML_ASSERT(f < 8);
    kvq_set_tag(fa, (kvq_tag(fa) & ~(7 << GGML_KVQ_PREROPE_HSKIP_SHIFT)) | (f << GGML_KVQ_PREROPE_HSKIP_SHIFT));
}

int ggml_kvq_fa_get_hadamard_skip(const struct ggml_tensor * fa) {
    if (!ggml_kvq_fa_get_prerope(fa, NULL, NULL, NULL, NULL)) {
        return 0;
    }
    const int f = (kvq_tag(fa) >> GGML_KVQ_PREROPE_HSKIP_SHIFT) & 7;
    return f ? 1 << (f - 1) : 0;
}

bool ggml_kvq_fa_get_prerope(const struct ggml_tensor * fa, int * n_dims, int * mode, float * mscale, int * n_rot_h) {
    if (fa->op != GGML_OP_FLASH_ATTN_EXT || fa->src[5] == NULL) {
        return false;
    }
    const int32_t tag = kvq_tag(fa);
    if ((tag & 0xFF000000) != GGML_KVQ_PREROPE_MAGIC) {
        return false;
    }
    const int lg = (tag >> 20) & 0xF;
    if (n_dims)  { *n_dims  = tag & 0xFFF; }
    if (mode)    { *mode    = (tag >> 16) & 0xF; }
    if (n_rot_h) { *n_rot_h = lg ? 1 << lg : 0; }
    if (mscale) { memcpy(mscale, fa->op_params + GGML_KVQ_PREROPE_TAG + 1, sizeof(float)); }
    return true;
}

// as ggml-cpu's rope_yarn_ramp
static float kvq_yarn_ramp(float low, float high, int i0) {
    const float y = (i0 / 2 - low) / fmaxf(0.001f, high - low);
    return 1.0f - fminf(1.0f, fmaxf(0.0f, y));
}

float ggml_kvq_rope_freqs(int n_dims, int n_ctx_orig, float freq_base, float freq_scale, float ext_factor,
                          float attn_factor, float beta_fast, float beta_slow,
                          const float * ff, int ff_cols, int n_cols, float * out) {
    float corr_dims[2];
    ggml_rope_yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow, corr_dims);
    const float theta_scale = powf(freq_base, -2.0f/n_dims);
    const int n_pairs = n_dims/2;
    for (int h = 0; h < n_cols; ++h) {
        const float * ffh = ff ? ff + (ff_cols > 1 ? h : 0)*n_pairs : NULL;
        float theta = 1.0f;      // the CPU kernel's running product theta_scale^i, in float
        for (int i = 0; i < n_pairs; ++i) {
            const float extrap = theta / (ffh ? ffh[i] : 1.0f);
            float w = freq_scale*extrap;
            if (ext_factor != 0.0f) {
                const float r = kvq_yarn_ramp(corr_dims[0], corr_dims[1], 2*i) * ext_factor;
                w = w*(1 - r) + extrap*r;
            }
            out[h*n_pairs + i] = w;
            theta *= theta_scale;
        }
    }
    return ext_factor != 0.0f ? attn_factor*(1.0f + 0.1f*logf(1.0f/freq_scale)) : attn_factor;
}
