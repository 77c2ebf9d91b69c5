// Graph node names as llama.cpp's model builders give them ("Kcur-12"): shared by the eval-callback readers
// (llama-kvq-calib.cpp, llama-kvq-probe.cpp).
#pragma once

#include <cstdlib>
#include <cstring>

// "<prefix>...-<il>" -> il, or -1
inline int llama_kvq_layer_of(const char * name, const char * prefix) {
    const size_t np = strlen(prefix);
    if (strncmp(name, prefix, np) != 0) {
        return -1;
    }
    const char * dash = strrchr(name, '-');
    if (dash == nullptr || dash[1] == '\0') {
        return -1;
    }
    char * end = nullptr;
    const long il = strtol(dash + 1, &end, 10);
    return (*end == '\0' && il >= 0 && il < 100000) ? (int) il : -1;
}
