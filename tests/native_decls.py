"""What pykvq's binding leaves out and the tests use: the reference codecs, the CPU kernels' variants, a little of
ggml's graph API and a few llama.h functions. Added to pykvq's FFI (cffi lets a later cdef extend the
libraries already opened) when this module is imported: tests/conftest.py and scripts that reuse the tests' harness."""
from __future__ import annotations

from pykvq._lib import ffi

TEST_CDEF = r"""
uint64_t llama_model_size(const struct llama_model * model);
uint64_t llama_model_n_params(const struct llama_model * model);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
bool llama_vocab_get_add_eos(const struct llama_vocab * vocab);
bool ggml_is_quantized(int type);
int32_t llama_model_n_ctx_train(const struct llama_model * model);
bool llama_supports_gpu_offload(void);
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
struct llama_context * llama_kvq_init_from_model(struct llama_model * model, struct llama_context_params params,
                                                 int attn_rot_k, int attn_rot_v);

/* pykvq native (ggml-kvq.h, ggml-kvq-cpu.h): reference codecs in ggml-base, kernels in ggml-cpu (ggml_to_float_t,
   ggml_from_float_t and ggml_get_type_traits come with pykvq._lib's declarations) */
const char * ggml_kvq_version(void);
bool ggml_kvq_cpu_set_fa_mode(const char * mode);
const char * ggml_kvq_cpu_fa_mode(void);
void quantize_row_bfp4_32_ref(const float * x, void * y, int64_t k);
void quantize_row_bfp4_64_ref(const float * x, void * y, int64_t k);
void quantize_row_bfp8_32_ref(const float * x, void * y, int64_t k);
void dequantize_row_bfp4_32(const void * x, float * y, int64_t k);
void dequantize_row_bfp4_64(const void * x, float * y, int64_t k);
void dequantize_row_bfp8_32(const void * x, float * y, int64_t k);
typedef void (*ggml_vec_dot_t)(int n, float * s, size_t bs, const void * x, size_t bx, const void * y, size_t by, int nrc);
struct ggml_type_traits_cpu { ggml_from_float_t from_float; ggml_vec_dot_t vec_dot; int vec_dot_type; int64_t nrows; };
const struct ggml_type_traits_cpu * ggml_get_type_traits_cpu(int type);
int             ggml_kvq_cpu_n_impls(void);
const char *    ggml_kvq_cpu_impl_name(int i);
ggml_vec_dot_t  ggml_kvq_cpu_impl_vec_dot(int i, int type);
ggml_to_float_t ggml_kvq_cpu_impl_to_float(int i, int type);
ggml_to_float_t ggml_kvq_cpu_to_float_k(int type);
ggml_from_float_t ggml_kvq_cpu_impl_from_float(int i, int type);

/* nuq*: reference codecs with an explicit codebook (NULL = fallback), the trait functions
   (thread-bound codebook), codebooks in op_params, thread binding (ggml-kvq.h) */
void quantize_row_nuq4_ref_cb(const float * x, void * y, int64_t k, const int8_t * cb);
void quantize_row_nuq3_ref_cb(const float * x, void * y, int64_t k, const int8_t * cb);
void quantize_row_nuq2_ref_cb(const float * x, void * y, int64_t k, const int8_t * cb);
void quantize_row_nuq3o_ref_cb(const float * x, void * y, int64_t k, const int8_t * cb);
void quantize_row_nuq2o_ref_cb(const float * x, void * y, int64_t k, const int8_t * cb);
void quantize_row_nuq3_64_ref_cb(const float * x, void * y, int64_t k, const int8_t * cb);
void quantize_row_nuq2_64_ref_cb(const float * x, void * y, int64_t k, const int8_t * cb);
void dequantize_row_nuq4_cb(const void * x, float * y, int64_t k, const int8_t * cb);
void dequantize_row_nuq3_cb(const void * x, float * y, int64_t k, const int8_t * cb);
void dequantize_row_nuq2_cb(const void * x, float * y, int64_t k, const int8_t * cb);
void dequantize_row_nuq3o_cb(const void * x, float * y, int64_t k, const int8_t * cb);
void dequantize_row_nuq2o_cb(const void * x, float * y, int64_t k, const int8_t * cb);
void dequantize_row_nuq3_64_cb(const void * x, float * y, int64_t k, const int8_t * cb);
void dequantize_row_nuq2_64_cb(const void * x, float * y, int64_t k, const int8_t * cb);
void quantize_row_nuq4_ref(const float * x, void * y, int64_t k);
void quantize_row_nuq3_ref(const float * x, void * y, int64_t k);
void quantize_row_nuq2_ref(const float * x, void * y, int64_t k);
void quantize_row_nuq3o_ref(const float * x, void * y, int64_t k);
void quantize_row_nuq2o_ref(const float * x, void * y, int64_t k);
void quantize_row_nuq3_64_ref(const float * x, void * y, int64_t k);
void quantize_row_nuq2_64_ref(const float * x, void * y, int64_t k);
void dequantize_row_nuq4(const void * x, float * y, int64_t k);
void dequantize_row_nuq3(const void * x, float * y, int64_t k);
void dequantize_row_nuq2(const void * x, float * y, int64_t k);
void dequantize_row_nuq3o(const void * x, float * y, int64_t k);
void dequantize_row_nuq2o(const void * x, float * y, int64_t k);
void dequantize_row_nuq3_64(const void * x, float * y, int64_t k);
void dequantize_row_nuq2_64(const void * x, float * y, int64_t k);
bool ggml_kvq_is_nuq(int type);
int ggml_kvq_nuq_n_codes(int type);
const int8_t * ggml_kvq_nuq_fallback(int type);
bool ggml_kvq_nuq_codebook_ok(const int8_t * cb, int n);
void ggml_kvq_bind_codebooks(const int8_t * cb_a, const int8_t * cb_b);
void ggml_kvq_cpu_bind_codebooks(const int8_t * cb_a, const int8_t * cb_b);
bool ggml_validate_row_data(int type, const void * data, size_t nbytes);
void quantize_row_tcq3_64_ref(const float * x, void * y, int64_t k);
void quantize_row_tcq2_64_ref(const float * x, void * y, int64_t k);
void dequantize_row_tcq3_64(const void * x, float * y, int64_t k);
void dequantize_row_tcq2_64(const void * x, float * y, int64_t k);
void quantize_row_tcq3_128_ref(const float * x, void * y, int64_t k);
void quantize_row_tcq2_128_ref(const float * x, void * y, int64_t k);
void dequantize_row_tcq3_128(const void * x, float * y, int64_t k);
void dequantize_row_tcq2_128(const void * x, float * y, int64_t k);
void quantize_row_tcq25_64_ref(const float * x, void * y, int64_t k);
void dequantize_row_tcq25_64(const void * x, float * y, int64_t k);
void quantize_row_tcq35_64_ref(const float * x, void * y, int64_t k);
void dequantize_row_tcq35_64(const void * x, float * y, int64_t k);
void quantize_row_q4t2_64_ref(const float * x, void * y, int64_t k);
void dequantize_row_q4t2_64(const void * x, float * y, int64_t k);
void quantize_row_t32_64_ref(const float * x, void * y, int64_t k);
void dequantize_row_t32_64(const void * x, float * y, int64_t k);
const int16_t * ggml_kvq_tcq_tables(int type, int j);
int ggml_kvq_tcq_bits(int type, int j);
int ggml_kvq_tcq_block(int type);
void quantize_row_q8_0_ref(const float * x, void * y, int64_t k);

/* a little of ggml's graph API, to run single ops on the CPU backend in the tests */
struct ggml_context;
struct ggml_tensor;
struct ggml_cgraph;
struct ggml_init_params { size_t mem_size; void * mem_buffer; bool no_alloc; };
struct ggml_context * ggml_init(struct ggml_init_params params);
void ggml_free(struct ggml_context * ctx);
struct ggml_tensor * ggml_new_tensor_1d(struct ggml_context * ctx, int type, int64_t ne0);
struct ggml_tensor * ggml_new_tensor_2d(struct ggml_context * ctx, int type, int64_t ne0, int64_t ne1);
struct ggml_tensor * ggml_new_tensor_3d(struct ggml_context * ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2);
struct ggml_tensor * ggml_new_tensor_4d(struct ggml_context * ctx, int type, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
void * ggml_get_data(const struct ggml_tensor * tensor);
size_t ggml_nbytes(const struct ggml_tensor * tensor);
struct ggml_tensor * ggml_set_rows(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b, struct ggml_tensor * c);
struct ggml_tensor * ggml_get_rows(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_cpy(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_cast(struct ggml_context * ctx, struct ggml_tensor * a, int type);
struct ggml_tensor * ggml_mul_mat(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_flash_attn_ext(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
                                         struct ggml_tensor * v, struct ggml_tensor * mask, float scale, float max_bias, float logit_softcap);
void ggml_flash_attn_ext_add_sinks(struct ggml_tensor * a, struct ggml_tensor * sinks);
void ggml_flash_attn_ext_set_n_kv_max(struct ggml_tensor * a, int32_t n_kv_max);
int ggml_flash_attn_ext_get_prec(const struct ggml_tensor * a);
struct ggml_cgraph * ggml_new_graph(struct ggml_context * ctx);
void ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
int ggml_graph_compute_with_ctx(struct ggml_context * ctx, struct ggml_cgraph * cgraph, int n_threads);
void ggml_kvq_set_codebook(struct ggml_tensor * node, const int8_t * cb);
void ggml_kvq_set_codebooks_fa(struct ggml_tensor * fa, const int8_t * cb_k, const int8_t * cb_v);
unsigned ggml_kvq_get_codebooks(const struct ggml_tensor * node, int8_t * cb_a, int8_t * cb_b);
void ggml_kvq_fa_set_prerope(struct ggml_tensor * fa, struct ggml_tensor * pos, struct ggml_tensor * mean,
                             struct ggml_tensor * scale, struct ggml_tensor * freqs, int n_dims, int mode, float mscale,
                             int n_rot_h);
void ggml_kvq_fa_set_centred(struct ggml_tensor * fa, struct ggml_tensor * pos, struct ggml_tensor * mean,
                             struct ggml_tensor * freqs, int n_dims, int mode, float mscale, int n_rot_h);
bool ggml_kvq_fa_is_centred(const struct ggml_tensor * fa);
void ggml_kvq_fa_set_window(struct ggml_tensor * fa, struct ggml_tensor * rows);
void ggml_kvq_fa_set_hadamard_skip(struct ggml_tensor * fa, int stride);
int ggml_kvq_fa_get_hadamard_skip(const struct ggml_tensor * fa);
void ggml_kvq_lsq_block(const float * x, int half, uint8_t * d_out, uint8_t * q);
void ggml_kvq_cpu_lsq_block(const float * x, int half, uint8_t * d_out, uint8_t * q);
void quantize_row_q4_0_lsq(const float * x, void * y, int64_t k);
void quantize_row_q5_0_lsq(const float * x, void * y, int64_t k);
void ggml_kvq_set_encoder(struct ggml_tensor * node, int encoder);
int ggml_kvq_get_encoder(const struct ggml_tensor * node);
float ggml_kvq_rope_freqs(int n_dims, int n_ctx_orig, float freq_base, float freq_scale, float ext_factor,
                          float attn_factor, float beta_fast, float beta_slow,
                          const float * ff, int ff_cols, int n_cols, float * out);
"""

ffi.cdef(TEST_CDEF)
