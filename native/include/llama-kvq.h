#pragma once

// pykvq: the llama side of the cache types (libllama; native/llama/llama-kvq*.cpp), for upstream's hooks in one
// include: codebooks on graph nodes, a context's settings, the pre-RoPE / centred key cache, memories, what a converted
// file asks for. pykvq's own files include the part they use.

#include "llama-kvq-api.h"
#include "llama-kvq-codebooks.h"
#include "llama-kvq-memory.h"
#include "llama-kvq-model.h"
#include "llama-kvq-prerope.h"
#include "llama-kvq-settings.h"
