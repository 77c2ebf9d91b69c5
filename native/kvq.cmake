# Included from ggml/src/CMakeLists.txt (the build seam, 0001-kvq-build.patch) once ggml-base exists.
# GGML_KVQ_DIR is this directory; the top-level CMakeLists.txt sets it.
#
# Sources that extend ggml-base (type traits, reference quantizers) go here;
# the public include directory and the GGML_KVQ definition propagate to every
# target that links ggml (ggml-cpu, llama, the tools), so hooks can #ifdef.

target_sources(ggml-base PRIVATE
    ${GGML_KVQ_DIR}/ggml/ggml-kvq.c
    ${GGML_KVQ_DIR}/ggml/kvq-validate.c
    ${GGML_KVQ_DIR}/ggml/bfp.c
    ${GGML_KVQ_DIR}/ggml/nuq.c
    ${GGML_KVQ_DIR}/ggml/q53.c
    ${GGML_KVQ_DIR}/ggml/tcq.c
    ${GGML_KVQ_DIR}/ggml/lsq.c
    ${GGML_KVQ_DIR}/ggml/prerope.c
    ${GGML_KVQ_DIR}/ggml/ggml-kvq-rpc.cpp
)
target_include_directories(ggml-base PUBLIC ${GGML_KVQ_DIR}/include)
target_compile_definitions(ggml-base PUBLIC GGML_KVQ)

# CPU kernels: added to every ggml-cpu variant with that variant's arch flags
# (the build seam, ggml/src/ggml-cpu/CMakeLists.txt).
set(GGML_KVQ_CPU_SOURCES
    ${GGML_KVQ_DIR}/ggml/cpu/bfp-cpu.c
    ${GGML_KVQ_DIR}/ggml/cpu/nuq-cpu.c
    ${GGML_KVQ_DIR}/ggml/cpu/q53-cpu.c
    ${GGML_KVQ_DIR}/ggml/cpu/tcq-cpu.c
    ${GGML_KVQ_DIR}/ggml/cpu/lsq-cpu.c
    ${GGML_KVQ_DIR}/ggml/cpu/kvq-dispatch.c
    ${GGML_KVQ_DIR}/ggml/cpu/fattn.cpp
    ${GGML_KVQ_DIR}/ggml/cpu/fattn-rows.cpp
    ${GGML_KVQ_DIR}/ggml/cpu/fattn-prerope.cpp
    ${GGML_KVQ_DIR}/ggml/cpu/fattn-centred.cpp
)

# CUDA kernels (PYKVQ_CUDA=ON): added to ggml-cuda by the build seam, compiled with its flags
# and architectures; they include ggml-cuda's own headers (common.cuh, fattn.cuh).
set(GGML_KVQ_CUDA_SOURCES
    ${GGML_KVQ_DIR}/ggml/cuda/kvq-cuda.cu
    ${GGML_KVQ_DIR}/ggml/cuda/kvq-fattn-d64.cu
    ${GGML_KVQ_DIR}/ggml/cuda/kvq-fattn-d128.cu
    ${GGML_KVQ_DIR}/ggml/cuda/kvq-fattn-d256.cu
)

# libllama's side (src/CMakeLists.txt, the build seam): a cache variable, since llama's directory is ggml's sibling
set(LLAMA_KVQ_SOURCES
    ${GGML_KVQ_DIR}/llama/llama-kvq.cpp
    ${GGML_KVQ_DIR}/llama/llama-kvq-memory.cpp
    ${GGML_KVQ_DIR}/llama/llama-kvq-model.cpp
    ${GGML_KVQ_DIR}/llama/llama-kvq-prerope.cpp
    ${GGML_KVQ_DIR}/llama/llama-kvq-calib.cpp
    ${GGML_KVQ_DIR}/llama/llama-kvq-probe.cpp
    ${GGML_KVQ_DIR}/llama/llama-kvq-window.cpp
    CACHE INTERNAL "pykvq's libllama sources")
