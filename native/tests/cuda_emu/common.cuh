// Host emulation of the CUDA features native/ggml/cuda/kvq-fattn.cuh's kernels use, so the very
// kernel source runs on a machine without a GPU (tests/test_cuda.py). Each CUDA thread is a
// fiber (ucontext); a warp's shuffles and a block's __syncthreads are barriers over its fibers,
// so divergent warps keep their meaning. Blocks run one after another, so __shared__ arrays are
// function statics. Stands in for ggml-cuda's common.cuh only in this build.
#pragma once

#include "ggml.h"
#include "ggml-kvq.h"

#include <ucontext.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define WARP_SIZE 32

using std::min;
using std::max;

struct float2 { float x, y; };
static inline float2 make_float2(float x, float y) { return { x, y }; }
struct half  { uint16_t bits; };
struct half2 { half x, y; };
static inline float  __half2float(half h)    { return ggml_kvq_fp16_to_fp32(h.bits); }
static inline float2 __half22float2(half2 h) { return { __half2float(h.x), __half2float(h.y) }; }

namespace emu {

struct idx3 { unsigned x, y, z; };

struct fiber {
    ucontext_t        ctx;
    std::vector<char> stack;
    idx3              tid;
    bool              done;
};

struct barrier_state {
    int  count = 0;
    long gen   = 0;
};

inline std::vector<fiber>                 fibers;
inline int                                cur = 0;
inline ucontext_t                         sched;
inline idx3                               block_idx;
inline idx3                               block_dim;
inline int                                n_threads = 0;
inline std::vector<barrier_state>         warp_bar;
inline barrier_state                      block_bar;
inline float                              xch[32][32];
inline const std::function<void()> *      body = nullptr;

inline void yield() { swapcontext(&fibers[cur].ctx, &sched); }

inline void barrier(barrier_state & b, int n) {
    const long g = b.gen;
    if (++b.count == n) {
        b.count = 0;
        ++b.gen;
        return;
    }
    while (b.gen == g) {
        yield();
    }
}

inline const idx3 & thread_idx() { return fibers[cur].tid; }

inline float shfl(float v, int src) {
    const int w = (int) thread_idx().y;
    xch[w][thread_idx().x] = v;
    barrier(warp_bar[w], WARP_SIZE);
    const float r = xch[w][src & (WARP_SIZE - 1)];
    barrier(warp_bar[w], WARP_SIZE);
    return r;
}

inline void trampoline() {
    (*body)();
    fibers[cur].done = true;
    swapcontext(&fibers[cur].ctx, &sched);
}

// run `kernel` for every block of grid with block threads (block.x must be WARP_SIZE)
inline void launch(idx3 grid, idx3 block, const std::function<void()> & kernel) {
    body = &kernel;
    n_threads = (int) (block.x*block.y*block.z);
    block_dim = block;
    for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
    for (unsigned x = 0; x < grid.x; ++x) {
        block_idx = { x, y, z };
        fibers.assign(n_threads, fiber{});
        warp_bar.assign(block.y*block.z, barrier_state{});
        block_bar = barrier_state{};
        for (int t = 0; t < n_threads; ++t) {
            fiber & f = fibers[t];
            f.tid = { t % block.x, (t / block.x) % block.y, t / (block.x*block.y) };
            f.stack.resize(64*1024);
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp   = f.stack.data();
            f.ctx.uc_stack.ss_size = f.stack.size();
            f.ctx.uc_link = &sched;
            makecontext(&f.ctx, trampoline, 0);
        }
        for (long pass = 0;; ++pass) {
            bool all_done = true;
            for (int t = 0; t < n_threads; ++t) {
                if (!fibers[t].done) {
                    all_done = false;
                    cur = t;
                    swapcontext(&sched, &fibers[t].ctx);
                }
            }
            if (all_done) {
                break;
            }
            if (pass > 100000000) {
                fprintf(stderr, "emu: deadlock in block (%u, %u, %u)\n", x, y, z);
                abort();
            }
        }
    }
}

} // namespace emu

#define threadIdx (emu::thread_idx())
#define blockIdx  (emu::block_idx)
#define blockDim  (emu::block_dim)

static inline void  __syncthreads() { emu::barrier(emu::block_bar, emu::n_threads); }
static inline void  __syncwarp(unsigned = 0xffffffff) { emu::barrier(emu::warp_bar[emu::thread_idx().y], WARP_SIZE); }
static inline float __shfl_sync(unsigned, float v, int src, int = WARP_SIZE)     { return emu::shfl(v, src); }
static inline float __shfl_xor_sync(unsigned, float v, int mask, int = WARP_SIZE) { return emu::shfl(v, (int) emu::thread_idx().x ^ mask); }
static inline int   __shfl_sync(unsigned, int v, int src, int = WARP_SIZE) {   // exact: ints travel as their bits
    float f;
    memcpy(&f, &v, sizeof(f));
    f = emu::shfl(f, src);
    memcpy(&v, &f, sizeof(v));
    return v;
}
static inline unsigned __ballot_sync(unsigned, int pred) {
    unsigned m = 0;
    for (int l = 0; l < WARP_SIZE; ++l) {
        m |= (emu::shfl(pred ? 1.0f : 0.0f, l) != 0.0f ? 1u : 0u) << l;
    }
    return m;
}
// fibers run one at a time: an atomic is a plain read-modify-write
static inline int atomicMax(int * p, int v) { const int o = *p; *p = o > v ? o : v; return o; }

template <int width = WARP_SIZE>
static inline float warp_reduce_sum(float x) {
    for (int offset = width/2; offset > 0; offset >>= 1) {
        x += __shfl_xor_sync(0xffffffff, x, offset, width);
    }
    return x;
}

template <int width = WARP_SIZE>
static inline float warp_reduce_max(float x) {
    for (int offset = width/2; offset > 0; offset >>= 1) {
        x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset, width));
    }
    return x;
}

template <typename dst_t> static inline dst_t ggml_cuda_cast(float x);
template <> inline float ggml_cuda_cast<float>(float x) { return x; }
template <> inline half  ggml_cuda_cast<half>(float x)  { return half{ ggml_kvq_fp32_to_fp16(x) }; }
