// Sensitivity probes (pykvq.sensitivity, the converter's per-layer budgets): noise of a known size added to one
// layer's K or V as the model computes it, so the change of the output distribution says what an error in that
// cache slot costs, measured by the runtime itself in the memory that running the model takes (no backward pass).
//
// K: the output of the ROPE node named "Kcur-<il>" (what a post-RoPE cache stores), changed in place after it is
// computed and before anything reads it (the scheduler stops at every node the eval callback asks for). Noise of
// one standard deviation per KV head is isotropic within the head, so adding it after RoPE is the same as before.
// V: the first node named "Vcur-<il>" of each batch (the projection; later Vcur nodes, the bias sum and reshapes,
// carry the noise on), once per batch.
// Instead of noise a probe may add a given change (llama_kvq_probe_set_delta): a cache type's own rounding error,
// mapped to those nodes by the converter, so the runtime prices a candidate type of one slot as it would round.

#include "llama-kvq-api.h"
#include "llama-kvq-names.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

struct llama_kvq_probe {
    int32_t il = -1, which = 0;     // which: 1 k, 2 v; il < 0: off
    std::vector<float> sigma;       // [n_head_kv * head_dim] per-channel standard deviation
    const float * delta = nullptr;  // or: the change of the next batch's tensor, every element (caller's memory)
    int64_t n_delta = 0;
    uint64_t seed = 0;
    bool done = false;              // V: this batch's first Vcur-<il> was changed
    int64_t hits = 0;               // tensors changed since the last llama_kvq_probe_set
    std::string error;
};

namespace {

// counter-based: the same noise for the same (seed, element) whatever the thread count or batch split
uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

double uniform01(uint64_t h) {
    return ((h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

bool targets(const llama_kvq_probe * p, const ggml_tensor * t) {
    if (p->il < 0 || !p->error.empty()) {
        return false;
    }
    if (p->which == 1) {
        return t->op == GGML_OP_ROPE && llama_kvq_layer_of(t->name, "Kcur") == p->il;
    }
    return !p->done && llama_kvq_layer_of(t->name, "Vcur") == p->il;
}

void perturb(llama_kvq_probe * p, ggml_tensor * t) {
    const int64_t n = (int64_t) p->sigma.size();
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t) ||
        (t->buffer != nullptr && !ggml_backend_buffer_is_host(t->buffer))) {
        p->error = std::string("probe: ") + t->name + " is not a contiguous f32 tensor in host memory (" +
                   ggml_type_name(t->type) + "); run the probe on the CPU";
        return;
    }
    const int64_t ne = ggml_nelements(t);
    if (p->delta != nullptr) {
        if (ne != p->n_delta) {
            p->error = std::string("probe: ") + t->name + " has " + std::to_string(ne) + " values, the delta " +
                       std::to_string(p->n_delta) + " (one batch of the tokens it was made for)";
            return;
        }
        float * x = (float *) t->data;
        for (int64_t i = 0; i < ne; i++) {
            x[i] += p->delta[i];
        }
        p->done = true;
        p->hits++;
        return;
    }
    if (n == 0 || ne % n != 0 || (t->ne[0] != n && t->ne[0]*t->ne[1] != n)) {
        p->error = std::string("probe: ") + t->name + " has " + std::to_string(t->ne[0]) + " x " +
                   std::to_string(t->ne[1]) + " values per token, the probe's sigma " + std::to_string(n);
        return;
    }
    float * x = (float *) t->data;
    const uint64_t base = splitmix64(p->seed ^ ((uint64_t) p->il << 40) ^ ((uint64_t) p->which << 56));
    for (int64_t i = 0; i < ne; i += 2) {     // Box-Muller: two normals per draw
        const uint64_t h = splitmix64(base + (uint64_t) i);
        const double r = std::sqrt(-2.0 * std::log(uniform01(h))), a = 6.283185307179586 * uniform01(splitmix64(h));
        x[i] += (float) (p->sigma[i % n] * r * std::cos(a));
        if (i + 1 < ne) {
            x[i + 1] += (float) (p->sigma[(i + 1) % n] * r * std::sin(a));
        }
    }
    p->done = true;
    p->hits++;
}

} // namespace

extern "C" {

struct llama_kvq_probe * llama_kvq_probe_init(void) {
    return new llama_kvq_probe();
}

void llama_kvq_probe_free(struct llama_kvq_probe * probe) {
    delete probe;
}

bool llama_kvq_probe_eval_cb(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * p = (llama_kvq_probe *) user_data;
    if (ask) {
        return targets(p, t);
    }
    if (targets(p, t)) {
        perturb(p, t);
    }
    return true;
}

void llama_kvq_probe_attach(struct llama_kvq_probe * probe, struct llama_context_params * params) {
    params->cb_eval = llama_kvq_probe_eval_cb;
    params->cb_eval_user_data = probe;
}

bool llama_kvq_probe_set(struct llama_kvq_probe * probe, int32_t il, int32_t which, const float * sigma,
                         int64_t n, uint64_t seed) {
    probe->error.clear();
    probe->hits = 0;
    probe->done = false;
    probe->seed = seed;
    probe->delta = nullptr;
    probe->n_delta = 0;
    if (il < 0 || sigma == nullptr || n <= 0) {
        probe->il = -1;
        probe->sigma.clear();
        return true;
    }
    if (which != 1 && which != 2) {
        probe->error = "probe: which must be 1 (K) or 2 (V), got " + std::to_string(which);
        probe->il = -1;
        return false;
    }
    probe->il = il;
    probe->which = which;
    probe->sigma.assign(sigma, sigma + n);
    return true;
}

bool llama_kvq_probe_set_delta(struct llama_kvq_probe * probe, int32_t il, int32_t which, const float * delta,
                               int64_t n) {
    probe->error.clear();
    probe->done = false;
    if (which != 1 && which != 2) {
        probe->error = "probe: which must be 1 (K) or 2 (V), got " + std::to_string(which);
        probe->il = -1;
        return false;
    }
    probe->il = delta != nullptr && n > 0 ? il : -1;
    probe->which = which;
    probe->sigma.clear();
    probe->delta = delta;
    probe->n_delta = n;
    return true;
}

void llama_kvq_probe_next_batch(struct llama_kvq_probe * probe, uint64_t seed) {
    probe->done = false;
    probe->seed = seed;
}

int64_t llama_kvq_probe_hits(const struct llama_kvq_probe * probe) {
    return probe->hits;
}

const char * llama_kvq_probe_error(const struct llama_kvq_probe * probe) {
    return probe->error.c_str();
}

} // extern "C"
