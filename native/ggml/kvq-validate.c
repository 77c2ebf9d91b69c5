// pykvq: the check ggml_validate_row_data makes of a pykvq type's row (the type registration seam; ggml-base), by
// family: each family's own check lives beside its reference codec (nuq.c, q53.c, tcq.c).
#include "ggml-kvq.h"

#include <math.h>

bool ggml_kvq_validate_f16_scales(const void * data, size_t nbytes, size_t block_size, int n_scales) {
    if (block_size == 0 || nbytes % block_size != 0) {
        return false;
    }
    const uint8_t * b = (const uint8_t *) data;
    for (size_t i = 0; i < nbytes / block_size; ++i) {
        for (int j = 0; j < n_scales; ++j) {
            if (!isfinite(ggml_kvq_f16_bytes(b + i*block_size + 2*j))) {
                return false;
            }
        }
    }
    return true;
}

bool ggml_kvq_validate_row(enum ggml_type type, const void * data, size_t nbytes) {
    switch (ggml_kvq_type_family(type)) {
        case GGML_KVQ_FAMILY_BFP: return true;   // every exponent byte and mantissa is a value
        case GGML_KVQ_FAMILY_NUQ: return ggml_kvq_validate_row_nuq(type, data, nbytes);   // d (and ov) finite, oi < 64
        case GGML_KVQ_FAMILY_Q53: return ggml_kvq_validate_row_q53(type, data, nbytes);   // both scales finite
        case GGML_KVQ_FAMILY_TCQ: return ggml_kvq_validate_row_tcq(type, data, nbytes);   // the scale finite
        default:                  return false;
    }
}
