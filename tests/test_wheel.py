"""`pip install` builds it: a wheel of this checkout, installed in a fresh venv, gives `import pykvq`, `pykvq`,
`pykvq-convert` and the patched tools, loaded from the venv (never from the checkout), answering exactly as the
checkout's own build does.

setup.py builds into the suite's CMake build directory (PYKVQ_BUILD_DIR), so the wheel costs a configure and a no-op
build here, not a second compile. pip's build isolation and the venv's dependencies come from the package index, as
for any user: about a minute on every CI run.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import BIN, REPO, run_tool

from pykvq.tools import TOOLS

PROMPT = "What is the capital of France?"


def _run(cmd, *, cwd, timeout=900, env=None) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    assert res.returncode == 0, f"{' '.join(map(str, cmd))} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def wheel(module_tmp) -> Path:
    out = module_tmp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", REPO, "--no-deps", "-w", out], cwd=out,
         env={"PYKVQ_BUILD_DIR": str(BIN.parent)})
    wheels = list(out.glob("pykvq-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def venv(wheel, module_tmp, smollm2) -> Path:
    """A fresh venv with the wheel and its dependencies (nothing of the checkout on its path)."""
    root = module_tmp("venv")
    _run([sys.executable, "-m", "venv", root / "v"], cwd=root)
    _run([root / "v" / "bin" / "python", "-m", "pip", "install", "--quiet", wheel], cwd=root)
    return root / "v"


def test_wheel_holds_the_native_build(wheel):
    assert "linux" in wheel.name, "a native wheel is platform-tagged"
    with zipfile.ZipFile(wheel) as z:
        info = {i.filename: i for i in z.infolist()}
    for name in ("libllama.so", "libggml-base.so", "libggml-cpu.so", *TOOLS):
        assert f"pykvq/lib/{name}" in info, f"{name} missing from the wheel"
    for name in TOOLS:
        assert (info[f"pykvq/lib/{name}"].external_attr >> 16) & 0o111, f"{name} is not executable in the wheel"
    assert "convert/llama_cpp/convert_hf_to_gguf.py" in info, "upstream's HF converter (HF-checkpoint inputs)"
    assert not any(n.startswith(("tests/", "native/", "third_party/")) for n in info)


def test_import_loads_the_venv_library(venv, tmp_path):
    res = _run([venv / "bin" / "python", "-c", "import pykvq, pykvq._lib as L; print(L.lib_path()); "
                "print(pykvq.native_version())"], cwd=tmp_path)
    lib, version = res.stdout.split()
    assert Path(lib).resolve().is_relative_to(venv.resolve()), f"loaded {lib}, not the venv's copy"
    assert version not in ("None", "")


def test_generate_matches_the_checkout(venv, tmp_path, smollm2):
    """The README's line, in the venv, gives the checkout's greedy answer word for word."""
    import pykvq
    want = pykvq.generate(PROMPT, max_tokens=16)
    res = _run([venv / "bin" / "python", "-c", f"import pykvq; print(pykvq.generate({PROMPT!r}, max_tokens=16))"],
               cwd=tmp_path)
    assert res.stdout.rstrip("\n") == want
    assert "Paris" in want


def test_tools_run_from_the_venv(venv, tmp_path, smollm2):
    res = _run([venv / "bin" / "pykvq", "tool"], cwd=tmp_path)
    paths = res.stdout.split()
    assert [Path(p).name for p in paths] == list(TOOLS)
    assert all(Path(p).resolve().is_relative_to(venv.resolve()) for p in paths)
    args = ["-m", smollm2, "-p", "The capital of France is", "-n", "8", "--temp", "0", "-no-cnv", "-fa", "on",
            "-ctk", "q53_64", "-ctv", "nuq4", "-t", "2"]
    mine = _run([venv / "bin" / "pykvq", "tool", "llama-completion", *args], cwd=tmp_path)
    ref = run_tool("llama-completion", *args, timeout=300)
    assert ref.returncode == 0
    assert mine.stdout == ref.stdout and "France" in mine.stdout


def test_unknown_tool_is_a_clear_error(venv, tmp_path):
    res = subprocess.run([venv / "bin" / "pykvq", "tool", "llama-quantize"], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 2 and "unknown tool 'llama-quantize'" in res.stderr and "llama-server" in res.stderr


def test_converter_runs_from_the_venv(venv, tmp_path):
    """pykvq-convert comes with a plain `pip install` (GGUF inputs need no torch); --help opens with the presets."""
    res = _run([venv / "bin" / "pykvq-convert", "--help"], cwd=tmp_path)
    assert "--bits" in res.stdout
