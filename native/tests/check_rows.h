// Rows for the standalone kernel checks (nuq_check.c, q53_check.c): a fixed pseudo-random stream, so every
// build (-march variant, aarch64 under qemu) draws the same rows, and Q in q8_0 as ggml's reference makes it.
#pragma once

#include "ggml-kvq.h"

#include <math.h>
#include <stdint.h>

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint32_t urand(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t) (rng_state >> 33);
}

static float frand(void) {  // roughly normal, with occasional outliers
    float s = 0.0f;
    for (int i = 0; i < 4; ++i) {
        s += (float) (urand() & 0xFFFFFF) / 16777216.0f - 0.5f;
    }
    return (urand() % 97 == 0) ? 40.0f * s : s;
}

typedef struct { uint16_t d; int8_t qs[32]; } q8_block;   // ggml's block_q8_0

static void quantize_q8_0(const float * x, q8_block * y, int n) {
    for (int i = 0; i < n / 32; ++i) {
        float amax = 0.0f;
        for (int j = 0; j < 32; ++j) { amax = fmaxf(amax, fabsf(x[32*i + j])); }
        const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
        y[i].d = ggml_kvq_fp32_to_fp16(d);
        for (int j = 0; j < 32; ++j) { y[i].qs[j] = (int8_t) roundf(x[32*i + j] * id); }
    }
}
