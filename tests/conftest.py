"""Shared fixtures: the real default model, the real evaluation text, the built tools."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import native_decls  # noqa: F401  (the declarations only the tests use, added to pykvq's FFI)

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / "build" / "bin"

# A user's clone has nothing beside it: record every file this test process opens next to the
# checkout (REPO's parent, outside REPO, the cache and the temp directory); the session fails if any.
OUTSIDE_OPENS: list[str] = []


def _outside_checkout(path) -> bool:
    try:
        p = Path(os.fsdecode(path)).resolve()
    except (TypeError, ValueError, OSError):
        return False
    if not p.is_relative_to(REPO.parent) or p.is_relative_to(REPO):
        return False
    from pykvq.paths import cache_dir
    return not (p.is_relative_to(cache_dir().resolve()) or p.is_relative_to(Path(tempfile.gettempdir()).resolve()))


def _audit(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)) and _outside_checkout(args[0]):
        OUTSIDE_OPENS.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def pytest_sessionfinish(session, exitstatus):
    if OUTSIDE_OPENS:
        print(f"\nfiles opened outside the checkout {REPO} (a fresh clone has none of them):", *sorted(set(OUTSIDE_OPENS)), sep="\n  ")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

# A fixed WikiText-2 test passage for quick checks: the start of the split.
PASSAGE_CHARS = 20000


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not os.environ.get("PYKVQ_TEST_QWEN"):
        skips["qwen"] = pytest.mark.skip(reason="needs Qwen2.5-Coder-1.5B; set PYKVQ_TEST_QWEN=1")
    if not os.environ.get("PYKVQ_SOAK"):
        skips["soak"] = pytest.mark.skip(reason="long fuzz/soak run; set PYKVQ_SOAK=1 (make soak)")
    for item in items:
        for mark, skip in skips.items():
            if mark in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="module")
def module_tmp(request, tmp_path_factory):
    """tmp_path_factory.mktemp for a module-scoped fixture's files, removed once the module's tests are done (kept if
    one of them failed). Folders made with mktemp stay until the session ends, and with a converted model of 0.1-0.5 GB
    in each the suite's peak disk use would be their sum (CI once ran out of disk)."""
    made: list[Path] = []

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    failed = request.session.testsfailed
    yield mktemp
    if request.session.testsfailed == failed:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def text() -> str:
    """The calibration text (the Canterbury corpus), as the converter reads it; never the evaluation text."""
    from convert.calib import calibration_text
    return calibration_text("canterbury")[0]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from pykvq.registry import fetch
    return fetch("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2) -> Path:
    """SmolLM2 as an HF checkpoint (f32, dequantized from the GGUF by transformers), cached."""
    from convert.hf_checkpoint import hf_checkpoint
    return hf_checkpoint(smollm2)


@pytest.fixture(scope="session")
def smollm2_f32(smollm2, tmp_path_factory):
    """The same model with every tensor dequantized to f32 (a GGUF input whose matmuls are exact)."""
    from convert.gguf_io import read_gguf, write_gguf
    from convert.to_gguf import _dequantize_weights     # what --dequantize writes
    out = tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf"
    m = read_gguf(smollm2)
    _dequantize_weights(m)
    write_gguf(m, out)
    return out


@pytest.fixture(scope="session")
def smollm2_converted(smollm2, smollm2_hf, tmp_path_factory):
    """The real Q4_1 file with every transform (K-sort, smoothing, Hadamard V; V/O requantized to q8_0)."""
    from test_convert import TRANSFORMS, run_convert
    out = tmp_path_factory.mktemp("conv") / "smollm2-kvq.gguf"
    run_convert(smollm2, "-o", out, "--hf-dir", smollm2_hf, *TRANSFORMS["all"])
    return out


@pytest.fixture(scope="session")
def smollm2_prerope(smollm2, tmp_path_factory):
    """SmolLM2 converted with --prerope-k (the default calibration: 4 x 512 tokens, seconds), the window's rows in
    f16: the tests compare it bit for bit with f16 caches and RPC peers (whose rows are f16); q8_0 rows, the
    converter's default, are tested in test_window.py."""
    from test_convert import run_convert
    out = tmp_path_factory.mktemp("prerope") / "smol-prerope.gguf"
    run_convert(smollm2, "-o", out, "--prerope-k", "--kv-window-type", "f16")
    return out


@pytest.fixture(scope="session")
def smollm2_codebooks(smollm2, tmp_path_factory):
    """SmolLM2 with per-layer cache types and K codebooks from the file (weights untouched): nuq3 K with a codebook
    of its own in every layer but 0, whose K is q8_0; q8_0 V. For the server and RPC tests."""
    import numpy as np
    from gguf_variants import variant
    n_layer = 30
    cb = np.array([-120, -80, -45, -15, 15, 45, 80, 120], np.int8)
    return variant(smollm2, tmp_path_factory.mktemp("codebooks") / "smollm2-codebooks.gguf",
                   layer_types_k=["q8_0"] + ["nuq3"] * (n_layer - 1), layer_types_v=["q8_0"] * n_layer,
                   type_k="nuq3", type_v="q8_0", rot_k=True, codebooks_k={il: cb for il in range(1, n_layer)})


@pytest.fixture(scope="session")
def wikitext() -> str:
    from pykvq.data import wikitext_test
    return wikitext_test()


@pytest.fixture(scope="session")
def wiki_file(wikitext, tmp_path_factory) -> Path:
    """20k characters of WikiText-2 test in a file, for the llama.cpp tools' -f."""
    p = tmp_path_factory.mktemp("text") / "wiki.txt"
    p.write_text(wikitext[:20000])
    return p


@pytest.fixture(scope="session")
def passage(wikitext) -> str:
    return wikitext[:PASSAGE_CHARS]


@pytest.fixture(scope="session")
def f16_model(smollm2):
    from pykvq import Model
    m = Model(smollm2, n_ctx=1024, flash_attn=True)
    yield m
    m.close()


@pytest.fixture(scope="session")
def q8_model(smollm2):
    from pykvq import Model
    m = Model(smollm2, n_ctx=1024, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn=True)
    yield m
    m.close()


def tool(name: str) -> Path:
    p = BIN / name
    if not p.exists():
        pytest.fail(f"{p} is not built; run 'make build'")
    return p


def run_tool(name: str, *args, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs build/bin/<name>; env adds to (not replaces) this process's environment."""
    full_env = {**os.environ, **env} if env else None
    return subprocess.run([str(tool(name)), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=full_env)
