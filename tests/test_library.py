"""The patched library loads, carries the KVQ marker, and its type ids match ours."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pykvq
from pykvq import cache_types

from conftest import REPO, run_tool


def header_version() -> str:
    text = (REPO / "native/include/ggml-kvq.h").read_text()
    return re.search(r'#define GGML_KVQ_VERSION "([^"]+)"', text).group(1)


def test_library_reports_kvq_marker():
    info = pykvq.system_info()
    assert f"KVQ : version = {header_version()} |" in info
    assert pykvq.native_version() == header_version()


def test_cli_tools_report_kvq_marker(smollm2):
    # llama-completion prints the system info line at start-up
    r = run_tool("llama-completion", "-m", smollm2, "-p", "Hi", "-n", "1", "-no-cnv", "--no-warmup")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"KVQ : version = {header_version()}" in r.stdout + r.stderr


def test_cache_type_ids_match_ggml_names():
    from pykvq._lib import ffi, lib
    L = lib()
    for name, tid in cache_types.CACHE_TYPES.items():
        assert ffi.string(L.ggml_type_name(tid)).decode() == name


def _header_table() -> list[tuple]:
    """The rows of native/include/ggml-kvq-types.h's GGML_KVQ_TYPES."""
    import re
    text = (REPO / "native" / "include" / "ggml-kvq-types.h").read_text()
    rows = re.findall(r"^\s*X\((\w+),\s*(\w+),\s*(\d+),\s*(\d+),\s*(\w+),\s*(\w+),\s*(\w+),\s*([01]),\s*(\d+),"
                      r"\s*([01]),\s*(\d+),\s*__VA_ARGS__\)", text, re.M)
    assert len(rows) >= 9, "no table rows found"
    return rows


def test_one_type_table_on_both_sides():
    """pykvq/cache_types.py's KVQ_TYPES is the C table row for row, and the built library's type traits (block
    size, block bytes, name, vec_dot_type) are what the table says."""
    from pykvq._lib import ffi, lib
    L = lib()
    rows = _header_table()
    assert [r[0] for r in rows] == list(cache_types.KVQ_TYPES)
    for name, NAME, tid, qk, family, vdt, VDT, cuda, codes, outl, bits in rows:
        t = cache_types.KVQ_TYPES[name]
        assert NAME == name.upper() and VDT == vdt.upper()
        assert (t.id, t.qk, t.family, t.vec_dot_type, t.cuda, t.codes, t.outliers, round(t.bits * 1000)) == \
            (int(tid), int(qk), family.lower(), vdt, cuda == "1", int(codes), outl == "1", int(bits)), name
        tr = L.ggml_get_type_traits(t.id)
        assert ffi.string(tr.type_name).decode() == name and tr.blck_size == t.qk and tr.is_quantized
        assert tr.type_size == t.block_bytes and tr.type_size * 8 / tr.blck_size == t.bits
        assert L.ggml_get_type_traits_cpu(t.id).vec_dot_type == cache_types.CACHE_TYPES[t.vec_dot_type]
    for name, (tid, qk, bits) in cache_types.STOCK_TYPES.items():
        tr = L.ggml_get_type_traits(tid)
        assert ffi.string(tr.type_name).decode() == name and tr.blck_size == qk and tr.type_size * 8 / qk == bits


def test_library_not_built_gives_clear_error(tmp_path):
    code = "import pykvq\ntry:\n    pykvq.system_info()\nexcept pykvq.LibraryNotFoundError as e:\n    print('ERR', e)\n"
    env = dict(os.environ, PYKVQ_LIB=str(tmp_path / "nowhere" / "libllama.so"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERR") and "not built" in r.stdout and "make build" in r.stdout
