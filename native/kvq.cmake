# Included from ggml/src/CMakeLists.txt (patch 0001) once ggml-base exists.
# GGML_KVQ_DIR is this directory; the top-level CMakeLists.txt sets it.
#
# Sources that extend ggml-base (type traits, reference quantizers) go here;
# the public include directory and the GGML_KVQ definition propagate to every
# target that links ggml (ggml-cpu, llama, the tools), so hooks can #ifdef.

target_sources(ggml-base PRIVATE
    ${GGML_KVQ_DIR}/ggml-kvq.c
    ${GGML_KVQ_DIR}/bfp.c
    ${GGML_KVQ_DIR}/nuq.c
    ${GGML_KVQ_DIR}/q53.c
    ${GGML_KVQ_DIR}/lsq.c
    ${GGML_KVQ_DIR}/prerope.c
    ${GGML_KVQ_DIR}/ggml-kvq-rpc.cpp
)
target_include_directories(ggml-base PUBLIC ${GGML_KVQ_DIR}/include)
target_compile_definitions(ggml-base PUBLIC GGML_KVQ)

# CPU kernels: added to every ggml-cpu variant with that variant's arch flags
# (patch 0002, ggml/src/ggml-cpu/CMakeLists.txt).
set(GGML_KVQ_CPU_SOURCES
    ${GGML_KVQ_DIR}/cpu/bfp.c
    ${GGML_KVQ_DIR}/cpu/nuq.c
    ${GGML_KVQ_DIR}/cpu/q53.c
    ${GGML_KVQ_DIR}/cpu/lsq.c
    ${GGML_KVQ_DIR}/cpu/fattn.cpp
)

# CUDA kernels (PYKVQ_CUDA=ON): added to ggml-cuda by patch 0009, compiled with its flags
# and architectures; they include ggml-cuda's own headers (common.cuh, fattn.cuh).
set(GGML_KVQ_CUDA_SOURCES
    ${GGML_KVQ_DIR}/cuda/kvq-cuda.cu
    ${GGML_KVQ_DIR}/cuda/kvq-fattn-d64.cu
    ${GGML_KVQ_DIR}/cuda/kvq-fattn-d128.cu
    ${GGML_KVQ_DIR}/cuda/kvq-fattn-d256.cu
)
