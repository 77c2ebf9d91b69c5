// pykvq native entry points compiled into ggml-base (see native/kvq.cmake).
#include "ggml-kvq.h"

const char * ggml_kvq_version(void) {
    return GGML_KVQ_VERSION;
}
