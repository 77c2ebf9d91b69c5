// pykvq: the hostile-file driver (tests/test_hostile_files.py). For each GGUF it loads the model (mmap),
// makes a context with the file's own cache types (LLAMA_KV_CACHE_TYPE_MODEL, flash attention on) and decodes
// two tokens, then prints one line per file:
//
//   case <path>
//   ok                       loaded, decoded, logits finite (then " | warn: ..." with pykvq's warnings, if any)
//   ok nonfinite             loaded and decoded, but the logits hold inf/NaN (a silent wrong load)
//   error <message>          refused; <message> is what llama.cpp / pykvq logged at error level
//
// Files come from the command line, or one per line on stdin ("-"), so one process (one ASan start-up)
// runs a batch; a crash leaves "case <path>" as the last line, which names the culprit.
// Built with -DPYKVQ_SANITIZE=ON (build-asan/) it runs under AddressSanitizer and UBSan.
#include "llama.h"
#include "llama-kvq-api.h"

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

static std::string g_errors;
static std::string g_warnings;   // pykvq's own (an unknown pykvq.* key, ...)

static void log_cb(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::string s(text);
        while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) {
            s.pop_back();
        }
        if (!s.empty()) {
            g_errors += (g_errors.empty() ? "" : " | ") + s;
        }
    }
    if (level == GGML_LOG_LEVEL_WARN && (strstr(text, "pykvq") || strstr(text, "kvq_"))) {
        std::string s(text);
        while (!s.empty() && s.back() == '\n') {
            s.pop_back();
        }
        g_warnings += (g_warnings.empty() ? "" : " | ") + s;
    }
    if (getenv("KVQ_FUZZ_VERBOSE")) {
        fputs(text, stderr);
    }
}

static std::string one_line(std::string s) {
    for (char & c : s) {
        if (c == '\n' || c == '\r') {
            c = ' ';
        }
    }
    return s;
}

// "ok", "ok nonfinite" or "error ..." for one file
static std::string run_case(const char * path, int n_decode) {
    g_errors.clear();
    g_warnings.clear();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(path, mp);
    if (model == nullptr) {
        return "error " + (g_errors.empty() ? std::string("model load failed (nothing logged)") : g_errors);
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = 32;
    cp.n_batch         = 8;
    cp.n_ubatch        = 8;
    cp.n_seq_max       = 1;
    cp.n_threads       = 1;
    cp.n_threads_batch = 1;
    cp.type_k          = (ggml_type) LLAMA_KV_CACHE_TYPE_MODEL;
    cp.type_v          = (ggml_type) LLAMA_KV_CACHE_TYPE_MODEL;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.no_perf         = true;
    llama_context * ctx = llama_kvq_init_from_model(model, cp, LLAMA_ATTN_ROT_TYPE_AUTO, LLAMA_ATTN_ROT_TYPE_AUTO);
    if (ctx == nullptr) {
        llama_model_free(model);
        return "error " + (g_errors.empty() ? std::string("context creation failed (nothing logged)") : g_errors);
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::string res = "ok";
    for (int i = 0; i < n_decode && res == "ok"; ++i) {
        llama_token tok = (llama_token) ((1 + 7*i) % (n_vocab > 0 ? n_vocab : 1));
        llama_batch b = llama_batch_get_one(&tok, 1);
        if (llama_decode(ctx, b) != 0) {
            res = "error decode failed: " + g_errors;
            break;
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        for (int32_t j = 0; logits && j < n_vocab; ++j) {
            if (!std::isfinite(logits[j])) {
                res = "ok nonfinite";
                break;
            }
        }
    }
    llama_free(ctx);
    llama_model_free(model);
    return res + (g_warnings.empty() ? "" : " | warn: " + g_warnings);
}

int main(int argc, char ** argv) {
    int n_decode = 2;
    std::vector<std::string> files;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--decode") && i + 1 < argc) {
            n_decode = atoi(argv[++i]);
        } else {
            files.emplace_back(argv[i]);
        }
    }
    if (files.empty()) {
        fprintf(stderr, "usage: %s [--decode N] FILE.gguf... | -   (-: paths on stdin)\n", argv[0]);
        return 2;
    }
    llama_log_set(log_cb, nullptr);
    llama_backend_init();
    const auto one = [&](const std::string & f) {
        printf("case %s\n", f.c_str());
        fflush(stdout);
        printf("%s\n", one_line(run_case(f.c_str(), n_decode)).c_str());
        fflush(stdout);
    };
    for (const auto & f : files) {
        if (f == "-") {
            std::string line;
            while (std::getline(std::cin, line)) {
                if (!line.empty()) {
                    one(line);
                }
            }
        } else {
            one(f);
        }
    }
    llama_backend_free();
    return 0;
}
