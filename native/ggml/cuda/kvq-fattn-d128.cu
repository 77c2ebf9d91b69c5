// pykvq: decode kernels for head size 128 (one TU per head size keeps nvcc's jobs parallel).
#include "kvq-fattn.cuh"

KVQ_FA_DEFINE(128)
