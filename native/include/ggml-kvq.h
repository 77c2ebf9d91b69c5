// pykvq: KV-cache quantization types and hooks for ggml / llama.cpp.
//
// Everything pykvq adds to ggml is declared here; the bodies live next to this
// header in native/, and native/patches/ wires them into the pinned tree.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

#define GGML_KVQ_VERSION "0.1.0"

// Version string of the pykvq native code compiled into this ggml.
// Reported in llama_print_system_info() as "KVQ : version = ... |".
const char * ggml_kvq_version(void);

#ifdef __cplusplus
}
#endif
