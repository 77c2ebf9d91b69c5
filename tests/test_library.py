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


def test_library_not_built_gives_clear_error(tmp_path):
    code = "import pykvq\ntry:\n    pykvq.system_info()\nexcept pykvq.LibraryNotFoundError as e:\n    print('ERR', e)\n"
    env = dict(os.environ, PYKVQ_LIB=str(tmp_path / "nowhere" / "libllama.so"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERR") and "not built" in r.stdout and "make build" in r.stdout
