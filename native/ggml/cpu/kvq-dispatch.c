// The CPU entry points for every pykvq type, by family (ggml-kvq-types.h): each family's kernels and variant
// table live in its own file (cpu/bfp-cpu.c, cpu/nuq-cpu.c, cpu/q53-cpu.c, cpu/tcq-cpu.c); the variants are the same in each, in
// the same order, so one index names a variant across families.
#include "ggml-kvq-cpu.h"

ggml_to_float_t ggml_kvq_cpu_to_float(enum ggml_type type) {
    switch (ggml_kvq_type_family(type)) {
        case GGML_KVQ_FAMILY_BFP: return ggml_kvq_bfp_cpu_impl_to_float(ggml_kvq_bfp_cpu_n_impls() - 1, type);
        case GGML_KVQ_FAMILY_NUQ: return ggml_kvq_nuq_cpu_impl_to_float(ggml_kvq_nuq_cpu_n_impls() - 1, type);
        case GGML_KVQ_FAMILY_Q53: return type == GGML_TYPE_Q53_64  ? dequantize_row_q53_64_cpu
                                       : type == GGML_TYPE_Q42_64  ? dequantize_row_q42_64_cpu
                                       : type == GGML_TYPE_Q4T2_64 ? dequantize_row_q4t2_64_cpu
                                       : type == GGML_TYPE_T32_64  ? dequantize_row_t32_64_cpu : dequantize_row_q32_64_cpu;
        case GGML_KVQ_FAMILY_TCQ: return type == GGML_TYPE_TCQ3_64  ? dequantize_row_tcq3_64_cpu
                                       : type == GGML_TYPE_TCQ2_64  ? dequantize_row_tcq2_64_cpu
                                       : type == GGML_TYPE_TCQ25_64 ? dequantize_row_tcq25_64_cpu
                                       : type == GGML_TYPE_TCQ35_64 ? dequantize_row_tcq35_64_cpu
                                       : type == GGML_TYPE_TCQ3_128 ? dequantize_row_tcq3_128_cpu : dequantize_row_tcq2_128_cpu;
        default:                  return NULL;
    }
}

ggml_to_float_t ggml_kvq_cpu_to_float_k(enum ggml_type type) {
    if (ggml_kvq_type_is_nuq(type)) {    // K tiles read the K codebook (slot A)
        return ggml_kvq_nuq_cpu_impl_to_float_k(ggml_kvq_nuq_cpu_n_impls() - 1, type);
    }
    return ggml_kvq_cpu_to_float(type);  // no codebook: K and V decode alike
}

int ggml_kvq_cpu_n_impls(void) {
    return ggml_kvq_bfp_cpu_n_impls();
}

const char * ggml_kvq_cpu_impl_name(int i) {
    return ggml_kvq_bfp_cpu_impl_name(i);
}

// one variant's kernels, for the tests (the q53 family compiles one variant: NULL here)
ggml_vec_dot_t ggml_kvq_cpu_impl_vec_dot(int i, enum ggml_type type) {
    switch (ggml_kvq_type_family(type)) {
        case GGML_KVQ_FAMILY_BFP: return ggml_kvq_bfp_cpu_impl_vec_dot(i, type);
        case GGML_KVQ_FAMILY_NUQ: return ggml_kvq_nuq_cpu_impl_vec_dot(i, type);
        default:                  return NULL;
    }
}

ggml_to_float_t ggml_kvq_cpu_impl_to_float(int i, enum ggml_type type) {
    switch (ggml_kvq_type_family(type)) {
        case GGML_KVQ_FAMILY_BFP: return ggml_kvq_bfp_cpu_impl_to_float(i, type);
        case GGML_KVQ_FAMILY_NUQ: return ggml_kvq_nuq_cpu_impl_to_float(i, type);
        default:                  return NULL;
    }
}

ggml_from_float_t ggml_kvq_cpu_impl_from_float(int i, enum ggml_type type) {
    switch (ggml_kvq_type_family(type)) {
        case GGML_KVQ_FAMILY_BFP: return ggml_kvq_bfp_cpu_impl_from_float(i, type);
        case GGML_KVQ_FAMILY_NUQ: return ggml_kvq_nuq_cpu_impl_from_float(i, type);
        default:                  return NULL;
    }
}
