// pykvq: decode kernels for head size 64 (one TU per head size keeps nvcc's jobs parallel).
#include "kvq-fattn.cuh"

KVQ_FA_DEFINE(64)
