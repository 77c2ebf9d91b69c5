// pykvq: the check ggml_validate_row_data makes of a pykvq type's row (the type registration seam; ggml-base), by
// family: each family's own check lives beside its reference codec (nuq.c, q53.c, tcq.c).
#include "ggml-kvq.h"

bool ggml_kvq_validate_row(enum ggml_type type, const void * data, size_t nbytes) {
    switch (ggml_kvq_type_family(type)) {
        case GGML_KVQ_FAMILY_BFP: return true;   // every exponent byte and mantissa is a value
        case GGML_KVQ_FAMILY_NUQ: return ggml_kvq_validate_row_nuq(type, data, nbytes);   // d (and ov) finite, oi < 64
        case GGML_KVQ_FAMILY_Q53: return ggml_kvq_validate_row_q53(type, data, nbytes);   // both scales finite
        case GGML_KVQ_FAMILY_TCQ: return ggml_kvq_validate_row_tcq(type, data, nbytes);   // the scale finite
        default:                  return false;
    }
}
