// pykvq: the CUDA backend's view of the cache types (bodies in native/ggml/cuda/, wired into
// ggml-cuda.cu by the CUDA dispatch seam). C++ only: ggml-cuda is C++/CUDA.
#pragma once

#include "ggml.h"

struct ggml_backend_cuda_context;

// What supports_op should answer for a node that reads or writes a pykvq type.
enum ggml_kvq_cuda_support {
    GGML_KVQ_CUDA_NOT_OURS = -1,  // no pykvq type involved: upstream decides
    GGML_KVQ_CUDA_NO       =  0,  // involves a pykvq type and is not implemented
    GGML_KVQ_CUDA_YES      =  1,  // implemented in native/ggml/cuda
    GGML_KVQ_CUDA_AS_F16   =  2,  // FLASH_ATTN_EXT: supported when upstream supports *standin
                                  // (the same node with f16 K/V), which the prefill path runs
};

// A node with its K/V replaced by contiguous f16 tensors of the same shape (with an exact window: its rows
// appended, and the mask that chooses between a cell and its row in mask).
struct ggml_kvq_cuda_standin {
    ggml_tensor node;
    ggml_tensor k;
    ggml_tensor v;
    ggml_tensor mask;
};

// The answer for op (standin is filled for GGML_KVQ_CUDA_AS_F16).
int ggml_kvq_cuda_supports_op(const ggml_tensor * op, ggml_kvq_cuda_standin * standin);

// Runs op when it involves a pykvq type (SET_ROWS, CPY / DUP, FLASH_ATTN_EXT) and returns
// true; false for every other node, which ggml-cuda then runs itself.
bool ggml_kvq_cuda_compute_forward(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
