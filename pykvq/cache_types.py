"""KV-cache type names users can pick, and their ggml type ids.

The same names as llama.cpp's ``-ctk/-ctv`` (common/arg.cpp kv_cache_types);
new pykvq formats are added here as they land. Ids are ggml.h's enum ggml_type
values of the pinned tree (checked against ggml_type_name in the tests).
"""
from __future__ import annotations

from .errors import CacheTypeError

CACHE_TYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "bf16": 30,
    "q8_0": 8,
    "q4_0": 2,
    "q4_1": 3,
    "iq4_nl": 20,
    "q5_0": 6,
    "q5_1": 7,
    # pykvq block floating point (native/include/ggml-kvq.h)
    "bfp4_32": 43,
    "bfp4_64": 44,
    "bfp8_32": 45,
    # pykvq non-uniform codebook types (native/include/ggml-kvq.h, pykvq/ref/nuq.py)
    "nuq4": 46,
    "nuq3": 47,
    "nuq2": 48,
    "nuq3o": 49,
    "nuq2o": 50,
    # pykvq 5+3-bit split blocks, for keys laid out by importance (native/q53.c, pykvq/ref/q53.py)
    "q53_64": 51,
}

# ggml's enum names for every type above (pykvq.GGML_TYPE_NUQ4 == 46), e.g. for llama-cpp-python's type_k / type_v
GGML_TYPES: dict[str, int] = {f"GGML_TYPE_{name.upper()}": tid for name, tid in CACHE_TYPES.items()}

UNQUANTIZED = {"f32", "f16", "bf16"}

# llama.cpp's auto/off/on settings (llama_flash_attn_type, llama_attn_rot_type of patch 0003)
AUTO_OFF_ON = {None: -1, "auto": -1, False: 0, "off": 0, True: 1, "on": 1}


def rotation(value, which: str = "K") -> int:
    """llama_attn_rot_type for a user setting: "auto"/None, "on"/True, "off"/False."""
    key = value.strip().lower() if isinstance(value, str) else value
    if key not in AUTO_OFF_ON:
        raise ValueError(f"rotation of {which} must be 'auto', 'on' or 'off' (or None/True/False), got {value!r}")
    return AUTO_OFF_ON[key]


def resolve(name: str) -> int:
    """ggml type id of a cache type name; CacheTypeError if unknown."""
    key = str(name).strip().lower()
    if key not in CACHE_TYPES:
        raise CacheTypeError(
            f"unknown KV-cache type {name!r}; choose one of: {', '.join(CACHE_TYPES)}")
    return CACHE_TYPES[key]


def name_of(type_id: int) -> str:
    for k, v in CACHE_TYPES.items():
        if v == type_id:
            return k
    raise CacheTypeError(f"ggml type {type_id} is not a KV-cache type pykvq knows")
