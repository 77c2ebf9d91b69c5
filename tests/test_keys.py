"""pykvq/keys.py and its C mirror native/include/llama-kvq-keys.h say the same thing."""
from __future__ import annotations

import re

from conftest import REPO

from pykvq.keys import Keys, Tensors, Values, suffix

HEADER = REPO / "native" / "include" / "llama-kvq-keys.h"


def _constants(cls) -> dict[str, str]:
    return {k: v for k, v in vars(cls).items() if not k.startswith("_") and isinstance(v, str)}


def python_table() -> dict[str, str]:
    """keys.py as the header's macros: name -> string."""
    out = {}
    for group in (c for c in vars(Keys).values() if isinstance(c, type)):
        for name, value in _constants(group).items():
            out[f"LLAMA_KVQ_KEY_{group.__name__.upper()}_{name}"] = value
    out.update({f"LLAMA_KVQ_VALUE_{k}": v for k, v in _constants(Values).items()})
    out.update({f"LLAMA_KVQ_TENSOR_{k}": v.replace("{bid}", "%d") for k, v in _constants(Tensors).items()})
    return out


def header_table() -> dict[str, str]:
    text = HEADER.read_text()
    return dict(re.findall(r'^#define\s+(LLAMA_KVQ_(?:KEY|VALUE|TENSOR)_\w+)\s+"([^"]*)"\s*$', text, re.M))


def test_header_equals_keys_py():
    py, c = python_table(), header_table()
    assert len(py) > 30
    assert sorted(set(py) - set(c)) == [], "in pykvq/keys.py, missing from the header"
    assert sorted(set(c) - set(py)) == [], "in the header, missing from pykvq/keys.py"
    assert {k: c[k] for k in py if c[k] != py[k]} == {}


def test_every_key_is_unique_and_namespaced():
    keys = [v for k, v in python_table().items() if k.startswith("LLAMA_KVQ_KEY_")]
    assert len(keys) == len(set(keys))
    assert all(k.startswith("pykvq.") for k in keys)
    tensors = [v for k, v in _constants(Tensors).items()]
    assert len(tensors) == len(set(tensors))
    assert all(t.startswith("blk.{bid}.kvq_") for t in tensors)
    assert Tensors.CODEBOOK["k"].format(bid=3) == "blk.3.kvq_codebook_k"
    assert suffix(Tensors.ROPE_FREQS) == "kvq_rope_freqs"
    assert Keys.Cache.TYPE == {"k": Keys.Cache.TYPE_K, "v": Keys.Cache.TYPE_V}


def test_native_code_reads_only_known_keys():
    """Every "pykvq.<section>.<name>" string in native/ (sources and patches) is in the table."""
    known = set(python_table().values())
    files = [p for p in (REPO / "native").rglob("*") if p.suffix in (".c", ".cpp", ".h", ".cu", ".cuh", ".patch")]
    used = {m for p in files for m in re.findall(r'"(pykvq\.[a-z_]+(?:\.[a-z_]+)?)"', p.read_text(errors="replace"))}
    assert used, "no pykvq keys found in native/"
    assert sorted(used - known) == []
