"""pip's way in: `pip install .` builds the patched llama.cpp into the wheel.

A wheel build fetches the pinned, sha256-checked llama.cpp sdist and patches it (third_party/fetch.py), builds it
with CMake as `make build` does (same build directory, so a clone builds once), and puts the shared libraries and the
llama tools in pykvq/lib/, where pykvq/_lib.py looks first. The upstream HF converter goes along in convert/llama_cpp/
for HF-checkpoint inputs. An editable install (`make setup`) skips all of it: the clone's build/ serves it.

    CMAKE_ARGS="-DPYKVQ_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90" pip install .   # options pass through, as for llama-cpp-python
    PYKVQ_BUILD_DIR=/tmp/b pip install .                                       # another build directory (default: build/)
"""
from __future__ import annotations

import ast
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _tools() -> tuple[str, ...]:
    """pykvq/tools.py's TOOLS (read, not imported: the build environment lacks pykvq's dependencies)."""
    tree = ast.parse((ROOT / "pykvq" / "tools.py").read_text())
    return next(ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "TOOLS")


# what a wheel carries from the build's bin/: the tools pykvq runs (pykvq tool NAME, pykvq serve) and their libraries
TOOLS = _tools()
# upstream's HF -> GGUF converter and what it imports, for convert/to_gguf.py's HF-checkpoint inputs
UPSTREAM_CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py/gguf", "LICENSE")


def _run(cmd: list[str], env: dict) -> None:
    print("pykvq build:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def build_native(build_dir: Path) -> Path:
    """Fetch + patch llama.cpp, configure and build pykvq's targets; returns the directory of the built binaries."""
    if shutil.which("cmake") is None:
        sys.exit("pykvq: building the wheel needs CMake >= 3.18 and a C/C++ compiler (pip install cmake, or your "
                 "system's package)")
    env = dict(os.environ)
    # ccache (GGML_CCACHE) hashes paths relative to the checkout, so a fresh clone or pip's copy hits the cache
    env.setdefault("CCACHE_BASEDIR", str(ROOT))
    env.setdefault("CCACHE_NOHASHDIR", "1")
    _run([sys.executable, str(ROOT / "third_party" / "fetch.py")], env)
    _run(["cmake", "-S", str(ROOT), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
          f"-DPython3_EXECUTABLE={sys.executable}", *shlex.split(env.get("CMAKE_ARGS", ""))], env)
    jobs = env.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
    _run(["cmake", "--build", str(build_dir), "-j", jobs, "--target", "llama", *TOOLS], env)
    return build_dir / "bin"


def stage_native(bin_dir: Path, pkg_lib: Path) -> list[str]:
    """Copy the shared libraries (unversioned sonames: CMakeLists.txt) and the tools into the package; RUNPATH
    $ORIGIN lets them find each other there."""
    pkg_lib.mkdir(parents=True, exist_ok=True)
    staged = []
    for p in [*sorted(bin_dir.glob("lib*.so")), *(bin_dir / t for t in TOOLS)]:
        if not p.is_file() or p.is_symlink():
            raise SystemExit(f"pykvq: the build did not produce {p} as a file (a stale build directory? "
                             "remove it and build again)")
        shutil.copy2(p, pkg_lib / p.name)
        staged.append(p.name)
    return staged


def stage_converter(tree: Path, dest: Path) -> None:
    for rel in UPSTREAM_CONVERTER:
        src, dst = tree / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)


class build_py_native(build_py):
    def run(self):
        super().run()
        if self.editable_mode or os.environ.get("PYKVQ_SKIP_NATIVE"):
            return                      # the clone's build/bin serves an editable install
        build_dir = Path(os.environ.get("PYKVQ_BUILD_DIR") or ROOT / "build").resolve()
        staged = stage_native(build_native(build_dir), Path(self.build_lib) / "pykvq" / "lib")
        stage_converter(ROOT / "third_party" / "llama.cpp", Path(self.build_lib) / "convert" / "llama_cpp")
        print(f"pykvq build: staged {len(staged)} files into pykvq/lib: {', '.join(staged)}", flush=True)


class BinaryDistribution(Distribution):
    """The wheel holds native code: tag it for this platform."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": build_py_native}, distclass=BinaryDistribution,
      # setuptools' own build files stay out of CMake's build/
      options={"build": {"build_base": str(Path("build") / "py")}})
