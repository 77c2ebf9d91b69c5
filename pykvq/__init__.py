"""pykvq: small KV caches for llama.cpp that keep the model's output.

    import pykvq
    print(pykvq.generate("What is the capital of France?", cache_type_k="q8_0", cache_type_v="q8_0"))

    m = pykvq.Model(cache_type_k="q4_0", cache_type_v="q4_0", flash_attn=True)
    base = pykvq.Model()                                   # f16 cache
    print(m.kl_divergence(text, baseline=base, n_ctx=512))
"""
from __future__ import annotations

from .cache_types import CACHE_TYPES, GGML_TYPES
from .errors import (CacheTypeError, ContextOverflowError, DecodeError, FetchError,
                     LibraryNotFoundError, ModelLoadError, PykvqError, SettingError)
from .metrics import KLDResult, PerplexityResult
from .cache_info import KVCacheInfo
from .model import Model

__version__ = "0.1.0"

# ggml type ids by their C names: pykvq.GGML_TYPE_NUQ4, pykvq.GGML_TYPE_BFP4_32, pykvq.GGML_TYPE_Q4_0, ...
globals().update(GGML_TYPES)

# llama-cpp-python loads libllama from $LLAMA_CPP_LIB_PATH: pykvq.use_with_llama_cpp() before `import llama_cpp`
# points it at pykvq's patched build (importing pykvq changes nothing in the environment)
from ._lib import llama_cpp_lib_path, use_with_llama_cpp  # noqa: E402

__all__ = ["Model", "generate", "system_info", "native_version", "llama_cpp_lib_path", "use_with_llama_cpp",
           "KVCacheInfo", "KLDResult",
           "PerplexityResult", "CACHE_TYPES", "PykvqError", "LibraryNotFoundError", "ModelLoadError",
           "CacheTypeError", "ContextOverflowError", "DecodeError", "FetchError", "SettingError", *GGML_TYPES]

_default_models: dict = {}


def generate(prompt: str, max_tokens: int = 128, *, model: str | None = None, cache_type_k: str = "f16",
             cache_type_v: str = "f16", n_ctx: int = 4096, **kwargs) -> str:
    """Generate a reply with the default model (SmolLM2-135M-Instruct) or the
    GGUF at `model`. Models are loaded once per (path, cache types, n_ctx)."""
    key = (model, cache_type_k, cache_type_v, n_ctx)
    if key not in _default_models:
        _default_models[key] = Model(model, n_ctx=n_ctx, cache_type_k=cache_type_k, cache_type_v=cache_type_v)
    return _default_models[key].generate(prompt, max_tokens=max_tokens, **kwargs)


def system_info() -> str:
    """llama.cpp's system info line (backends, SIMD features, the KVQ marker)."""
    from ._lib import ffi, lib
    return ffi.string(lib().llama_print_system_info()).decode()


def native_version() -> str | None:
    """Version of pykvq's native code in the loaded library (None if absent)."""
    import re
    m = re.search(r"KVQ : version = ([^ |]+)", system_info())
    return m.group(1) if m else None
