// The standalone checks link nuq.c / bfp.c without ggml.c: their GGML_ASSERT / GGML_ABORT land
// here. Include once per check program (C or C++).
#pragma once

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef __cplusplus
extern "C"
#endif
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    abort();
}
