#pragma once

// pykvq's cache types: one row each. Every list of them in C, C++ and CUDA is generated from this table (type
// traits, the type predicates, the case labels the upstream switches take, -ctk's list, llama-bench's names, the
// CUDA dispatch), and pykvq/cache_types.py's KVQ_TYPES is tested against it. Adding a type: docs/DEVELOPING.md.
//
//   X(name, NAME, id, qk, family, vdt, VDT, cuda, codes, outl, bits, ...)
//     name    ggml_type_name, -ctk; its block struct block_<name> and functions quantize_row_<name>[_ref],
//             dequantize_row_<name>, ggml_vec_dot_<name>_<vdt>
//     NAME    GGML_TYPE_<NAME>, whose value in ggml.h's enum must be id (checked in native/ggml/ggml-kvq.c)
//     qk      values per block
//     family  BFP (block floating point), NUQ (non-uniform codebook), Q53 (halves of two widths: 5+3, 4+2, 3+2; q4t2_64's second half and
//             both of t32_64's trellis-coded),
//             TCQ (trellis-coded: a path through a shift-register trellis per block)
//     vdt     the vec_dot_type Q is converted to for K·Q (VDT: its enum name)
//     cuda    1: CUDA kernels (native/ggml/cuda), 0: CPU only
//     codes   codebook entries (nuq), else 0;  outl: 1 when a block keeps its largest value exactly
//     bits    bits per value x 1000 (the block's bytes x 8000 / qk; checked against sizeof)
//   The trailing ... passes a caller's extra arguments through to X (GGML_KVQ_TYPES(X, args)); give at least one.
#define GGML_KVQ_TYPES(X, ...)                                                          \
    X(bfp4_32, BFP4_32, 43, 32, BFP, bfp8_32, BFP8_32, 1,  0, 0, 4250, __VA_ARGS__)     \
    X(bfp4_64, BFP4_64, 44, 64, BFP, bfp8_32, BFP8_32, 1,  0, 0, 4125, __VA_ARGS__)     \
    X(bfp8_32, BFP8_32, 45, 32, BFP, bfp8_32, BFP8_32, 1,  0, 0, 8250, __VA_ARGS__)     \
    X(nuq4,    NUQ4,    46, 32, NUQ, q8_0,    Q8_0,    1, 16, 0, 4500, __VA_ARGS__)     \
    X(nuq3,    NUQ3,    47, 32, NUQ, q8_0,    Q8_0,    1,  8, 0, 3500, __VA_ARGS__)     \
    X(nuq2,    NUQ2,    48, 32, NUQ, q8_0,    Q8_0,    1,  4, 0, 2500, __VA_ARGS__)     \
    X(nuq3o,   NUQ3O,   49, 64, NUQ, q8_0,    Q8_0,    1,  8, 1, 3625, __VA_ARGS__)     \
    X(nuq2o,   NUQ2O,   50, 64, NUQ, q8_0,    Q8_0,    1,  4, 1, 2625, __VA_ARGS__)     \
    X(q53_64,  Q53_64,  51, 64, Q53, q8_0,    Q8_0,    1,  0, 0, 4500, __VA_ARGS__)     \
    X(q42_64,  Q42_64,  52, 64, Q53, q8_0,    Q8_0,    1,  0, 0, 3500, __VA_ARGS__)     \
    X(q32_64,  Q32_64,  53, 64, Q53, q8_0,    Q8_0,    1,  0, 0, 3000, __VA_ARGS__)     \
    X(nuq3_64, NUQ3_64, 54, 64, NUQ, q8_0,    Q8_0,    1,  8, 0, 3250, __VA_ARGS__)     \
    X(nuq2_64, NUQ2_64, 55, 64, NUQ, q8_0,    Q8_0,    1,  4, 0, 2250, __VA_ARGS__)     \
    X(tcq3_64, TCQ3_64, 56, 64, TCQ, q8_0,    Q8_0,    0,  0, 0, 3125, __VA_ARGS__)     \
    X(tcq2_64, TCQ2_64, 57, 64, TCQ, q8_0,    Q8_0,    0,  0, 0, 2125, __VA_ARGS__)     \
    X(q4t2_64, Q4T2_64, 58, 64, Q53, q8_0,    Q8_0,    0,  0, 0, 3375, __VA_ARGS__)     \
    X(t32_64,  T32_64,  59, 64, Q53, q8_0,    Q8_0,    0,  0, 0, 2750, __VA_ARGS__)     \
    X(tcq3_128, TCQ3_128, 60, 128, TCQ, q8_0,  Q8_0,    0,  0, 0, 3125, __VA_ARGS__)    \
    X(tcq2_128, TCQ2_128, 61, 128, TCQ, q8_0,  Q8_0,    0,  0, 0, 2125, __VA_ARGS__)    \
    X(tcq25_64, TCQ25_64, 62, 64, TCQ, q8_0,   Q8_0,    0,  0, 0, 2625, __VA_ARGS__)    \
    X(tcq35_64, TCQ35_64, 63, 64, TCQ, q8_0,   Q8_0,    0,  0, 0, 3625, __VA_ARGS__)

// what the rows expand to in the upstream files the patches touch (one macro use each)
#define GGML_KVQ_CASE(name, NAME, ...)       case GGML_TYPE_##NAME:
#define GGML_KVQ_ENUM_ITEM(name, NAME, ...)  GGML_TYPE_##NAME,
#define GGML_KVQ_TYPE_CASES                  GGML_KVQ_TYPES(GGML_KVQ_CASE, 0)
#define GGML_KVQ_TYPE_LIST                   GGML_KVQ_TYPES(GGML_KVQ_ENUM_ITEM, 0)

// a row's flag as a condition: GGML_KVQ_IF(cuda)(tokens) keeps the tokens when cuda is 1
#define GGML_KVQ_IF_0(...)
#define GGML_KVQ_IF_1(...) __VA_ARGS__
#define GGML_KVQ_IF(flag) GGML_KVQ_IF_##flag

enum ggml_kvq_family { GGML_KVQ_FAMILY_NONE = 0, GGML_KVQ_FAMILY_BFP, GGML_KVQ_FAMILY_NUQ, GGML_KVQ_FAMILY_Q53, GGML_KVQ_FAMILY_TCQ };
