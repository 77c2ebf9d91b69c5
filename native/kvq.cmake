# Included from ggml/src/CMakeLists.txt (patch 0001) once ggml-base exists.
# GGML_KVQ_DIR is this directory; the top-level CMakeLists.txt sets it.
#
# Sources that extend ggml-base (type traits, reference quantizers) go here;
# the public include directory and the GGML_KVQ definition propagate to every
# target that links ggml (ggml-cpu, llama, the tools), so hooks can #ifdef.

target_sources(ggml-base PRIVATE
    ${GGML_KVQ_DIR}/ggml-kvq.c
)
target_include_directories(ggml-base PUBLIC ${GGML_KVQ_DIR}/include)
target_compile_definitions(ggml-base PUBLIC GGML_KVQ)
