// pykvq over llama.cpp's RPC backend: what a worker says it runs, and what a client remembers of it.
#include "ggml-kvq-rpc.h"

#include <cstring>
#include <map>
#include <mutex>
#include <string>

uint8_t ggml_kvq_rpc_hello_mark(const ggml_backend_t * backends, size_t n_backends) {
    // a client may place the cache on any of the worker's devices: advertise what all of them run
    uint8_t caps = n_backends > 0 ? GGML_KVQ_RPC_CAPS : 0;
    for (size_t i = 0; i < n_backends; ++i) {
        caps &= ggml_kvq_dev_caps(ggml_backend_get_device(backends[i]));
    }
    return GGML_KVQ_RPC_MARK | caps;
}

static std::mutex                     g_workers_mutex;
static std::map<std::string, uint8_t> g_workers;   // endpoint -> capability bits of its HELLO

bool ggml_kvq_rpc_accept_worker(const char * endpoint, uint8_t mark) {
    if ((mark & ~GGML_KVQ_RPC_CAPS) != GGML_KVQ_RPC_MARK) {
        return false;
    }
    std::lock_guard<std::mutex> lock(g_workers_mutex);
    g_workers[endpoint] = mark & GGML_KVQ_RPC_CAPS;
    return true;
}

int ggml_kvq_rpc_worker_caps(const char * endpoint) {
    std::lock_guard<std::mutex> lock(g_workers_mutex);
    auto it = g_workers.find(endpoint);
    return it == g_workers.end() ? -1 : it->second;
}

static const char * kvq_reg_name(ggml_backend_dev_t dev) {
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    return reg ? ggml_backend_reg_name(reg) : "";
}

uint8_t ggml_kvq_dev_caps(ggml_backend_dev_t dev) {
    const char * name = kvq_reg_name(dev);
    if (strcmp(name, "CPU") == 0) {
        return GGML_KVQ_RPC_PREROPE | GGML_KVQ_RPC_CENTRED | GGML_KVQ_RPC_WINDOW;
    }
    if (strcmp(name, "CUDA") == 0) {
        return GGML_KVQ_RPC_PREROPE | GGML_KVQ_RPC_CENTRED | GGML_KVQ_RPC_WINDOW;
    }
    if (strcmp(name, "RPC") == 0) {   // an RPC device's description is its worker's endpoint
        const int caps = ggml_kvq_rpc_worker_caps(ggml_backend_dev_description(dev));
        return caps < 0 ? 0 : (uint8_t) caps;
    }
    return 0;
}

bool ggml_kvq_dev_window_q8(ggml_backend_dev_t dev) {
    const char * name = kvq_reg_name(dev);
    return strcmp(name, "CPU") == 0 || strcmp(name, "CUDA") == 0;
}
