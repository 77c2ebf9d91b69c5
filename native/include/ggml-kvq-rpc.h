#pragma once

// pykvq over llama.cpp's RPC backend (the RPC seam, 0005-kvq-rpc.patch). pykvq's cache types and their node parameters
// (codebooks and pre-RoPE tags in op_params, src[5..8]) travel in ggml-rpc's tensor serialisation unchanged;
// what a stock worker lacks is the code to run them. A pykvq worker answers HELLO with a mark in the
// response's padding byte, where a stock worker sends 0, and a pykvq client refuses any other worker.
//
// The mark: bit 7 pykvq; bits 0-3 the layout of pykvq's node parameters (bump it when that layout changes);
// bits 4-6 what every backend of the worker runs beyond the plain cache types, so that the client can accept
// a pre-RoPE or centred key cache on a worker that has the kernels and refuse it, by name, on one that has not,
// and keep an exact window only on layers whose device reads it (a new capability needs no layout bump: an older
// worker leaves its bit clear).
#include "ggml-backend.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define GGML_KVQ_RPC_MARK     0x82   // pykvq, node-parameter layout 2 (layout 1 had no capability bits)
#define GGML_KVQ_RPC_CAPS     0x70
#define GGML_KVQ_RPC_PREROPE  0x10   // pre-RoPE keys in flash attention (CPU, CUDA)
#define GGML_KVQ_RPC_CENTRED  0x20   // centred post-RoPE keys (CPU, CUDA)
#define GGML_KVQ_RPC_WINDOW   0x40   // exact-window rows in pre-RoPE flash attention (CPU, CUDA): without it a layer keeps none

#ifdef __cplusplus
extern "C" {
#endif

// worker side: the HELLO padding byte for a worker computing on these backends
GGML_API uint8_t ggml_kvq_rpc_hello_mark(const ggml_backend_t * backends, size_t n_backends);
// what a device runs (GGML_KVQ_RPC_* bits): CPU and CUDA pre-RoPE, centred and the window, an RPC device
// what its worker's HELLO said (0 before it), any other none. The worker's mark and the client's check both use it.
GGML_API uint8_t ggml_kvq_dev_caps(ggml_backend_dev_t dev);
// whether a device's kernels read exact-window rows in q8_0 (CPU, CUDA); an RPC worker's HELLO has no bit for it
// (its rows stay f16)
GGML_API bool    ggml_kvq_dev_window_q8(ggml_backend_dev_t dev);

// client side: true when the worker at endpoint is a pykvq worker of this layout; remembers its capabilities
GGML_API bool ggml_kvq_rpc_accept_worker(const char * endpoint, uint8_t mark);
// the GGML_KVQ_RPC_* bits of the worker at endpoint (as its HELLO said); -1 when no HELLO was seen from it
GGML_API int  ggml_kvq_rpc_worker_caps(const char * endpoint);

#ifdef __cplusplus
}
#endif
