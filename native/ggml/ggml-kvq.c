// pykvq native entry points compiled into ggml-base (see native/kvq.cmake).
#include "ggml-kvq.h"

// each row of ggml-kvq-types.h against ggml.h's enum (the type registration seam) and its block struct
#define GGML_KVQ_CHECK_ROW(name, NAME, id, qk, family, vdt, VDT, cuda, codes, outl, bits, ...)                 \
    _Static_assert(GGML_TYPE_##NAME == (id), "ggml.h's GGML_TYPE_" #NAME " is not ggml-kvq-types.h's id");   \
    _Static_assert(sizeof(block_##name) * 8000 == (size_t) (bits) * (qk), #name ": bits x qk != block bytes"); \
    _Static_assert((id) < GGML_TYPE_COUNT, #name ": id beyond GGML_TYPE_COUNT");
GGML_KVQ_TYPES(GGML_KVQ_CHECK_ROW, 0)

const char * ggml_kvq_version(void) {
    return GGML_KVQ_VERSION;
}
