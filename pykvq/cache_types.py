"""KV-cache type names users can pick, and their ggml type ids.

The same names as llama.cpp's ``-ctk/-ctv`` (common/arg.cpp kv_cache_types). pykvq's own
formats are KVQ_TYPES, one row per row of native/include/ggml-kvq-types.h. Ids are ggml.h's
enum ggml_type values of the pinned tree (checked against the library in the tests).
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import CacheTypeError

# pykvq's own types: native/include/ggml-kvq-types.h's table, row for row (tests/test_library.py parses that
# header and checks both, and each row against ggml_get_type_traits of the built library)
@dataclass(frozen=True)
class KVQType:
    name: str
    id: int              # ggml_type
    qk: int              # values per block
    family: str          # "bfp" block floating point, "nuq" non-uniform codebook, "q53" halves of two widths (5+3, 4+2, 3+2; trellis halves in q4t2_64, t32_64),
                         # "tcq" trellis-coded
    vec_dot_type: str    # what Q is converted to for K·Q
    cuda: bool           # CUDA kernels (native/ggml/cuda); else CPU only
    codes: int           # codebook entries (nuq), else 0
    outliers: bool       # a block keeps its largest value exactly
    bits: float          # bits per value (the block's bytes x 8 / qk)

    @property
    def block_bytes(self) -> int:
        return round(self.bits * self.qk / 8)


KVQ_TYPES: dict[str, KVQType] = {t.name: t for t in (
    KVQType("bfp4_32", 43, 32, "bfp", "bfp8_32", True, 0, False, 4.25),
    KVQType("bfp4_64", 44, 64, "bfp", "bfp8_32", True, 0, False, 4.125),
    KVQType("bfp8_32", 45, 32, "bfp", "bfp8_32", True, 0, False, 8.25),
    KVQType("nuq4", 46, 32, "nuq", "q8_0", True, 16, False, 4.5),
    KVQType("nuq3", 47, 32, "nuq", "q8_0", True, 8, False, 3.5),
    KVQType("nuq2", 48, 32, "nuq", "q8_0", True, 4, False, 2.5),
    KVQType("nuq3o", 49, 64, "nuq", "q8_0", True, 8, True, 3.625),
    KVQType("nuq2o", 50, 64, "nuq", "q8_0", True, 4, True, 2.625),
    KVQType("q53_64", 51, 64, "q53", "q8_0", True, 0, False, 4.5),
    KVQType("q42_64", 52, 64, "q53", "q8_0", True, 0, False, 3.5),
    KVQType("q32_64", 53, 64, "q53", "q8_0", True, 0, False, 3.0),
    KVQType("nuq3_64", 54, 64, "nuq", "q8_0", True, 8, False, 3.25),
    KVQType("nuq2_64", 55, 64, "nuq", "q8_0", True, 4, False, 2.25),
    KVQType("tcq3_64", 56, 64, "tcq", "q8_0", False, 0, False, 3.125),
    KVQType("tcq2_64", 57, 64, "tcq", "q8_0", False, 0, False, 2.125),
    KVQType("q4t2_64", 58, 64, "q53", "q8_0", False, 0, False, 3.375),
    KVQType("t32_64", 59, 64, "q53", "q8_0", False, 0, False, 2.75),
    KVQType("tcq3_128", 60, 128, "tcq", "q8_0", False, 0, False, 3.125),
    KVQType("tcq2_128", 61, 128, "tcq", "q8_0", False, 0, False, 2.125),
    KVQType("tcq25_64", 62, 64, "tcq", "q8_0", False, 0, False, 2.625),
    KVQType("tcq35_64", 63, 64, "tcq", "q8_0", False, 0, False, 3.625),
)}

# upstream's -ctk/-ctv types: (ggml id, values per block, bits per value)
STOCK_TYPES: dict[str, tuple[int, int, float]] = {
    "f32": (0, 1, 32.0), "f16": (1, 1, 16.0), "bf16": (30, 1, 16.0), "q8_0": (8, 32, 8.5), "q4_0": (2, 32, 4.5),
    "q4_1": (3, 32, 5.0), "iq4_nl": (20, 32, 4.5), "q5_0": (6, 32, 5.5), "q5_1": (7, 32, 6.0),
}

CACHE_TYPES: dict[str, int] = {**{n: v[0] for n, v in STOCK_TYPES.items()}, **{n: t.id for n, t in KVQ_TYPES.items()}}


def _block_shape(name: str) -> tuple[int, float]:
    """(values per block, bits per value) of a cache type."""
    if name in KVQ_TYPES:
        return KVQ_TYPES[name].qk, KVQ_TYPES[name].bits
    if name in STOCK_TYPES:
        return STOCK_TYPES[name][1:]
    raise CacheTypeError(f"unknown KV cache type {name!r}")


def bits_per_value(name: str) -> float:
    """Bits per cached value of a cache type (its block's bytes x 8 / values)."""
    return _block_shape(name)[1]


def block_size(name: str) -> int:
    """Values per block of a cache type."""
    return _block_shape(name)[0]


# ggml's enum names for every type above (pykvq.GGML_TYPE_NUQ4 == 46), e.g. for llama-cpp-python's type_k / type_v
GGML_TYPES: dict[str, int] = {f"GGML_TYPE_{name.upper()}": tid for name, tid in CACHE_TYPES.items()}

UNQUANTIZED = {"f32", "f16", "bf16"}

# llama.cpp's auto/off/on settings (llama_flash_attn_type, llama_attn_rot_type of the tool flags seam)
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
