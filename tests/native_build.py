"""Build a standalone native/tests/*_check.c for one ISA (cross-compiled and run under qemu
for aarch64) and run it: the kernel variants this machine does not select get tested too."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# cpu/kvq-dispatch.c hands each type to its family's kernels (cpu/bfp-cpu.c, cpu/nuq-cpu.c, cpu/q53-cpu.c, cpu/tcq-cpu.c): every
# check links them all
SOURCES = [f"ggml/{s}" for s in ("cpu/kvq-dispatch.c", "cpu/bfp-cpu.c", "cpu/nuq-cpu.c", "cpu/q53-cpu.c", "cpu/tcq-cpu.c", "cpu/lsq-cpu.c",
                                  "bfp.c", "nuq.c", "q53.c", "tcq.c", "lsq.c", "ggml-kvq.c", "kvq-validate.c")]   # under native/
# compiler flag -> the /proc/cpuinfo flag a native x86 run needs
NEED = {"-mavx512vnni": "avx512_vnni", "-mavx512f": "avx512bw", "-mavx2": "avx2", "-march=haswell": "avx2"}
# compiler flag -> the runner kind of a build with it (the first one found names the build); qemu-aarch64 runs "neon"
KIND = {"-mavx512vnni": "avx512vnni", "-mavx512f": "avx512", "-mavx2": "avx2", "-march=haswell": "avx2"}
SIMD_KINDS = ("neon", "avx2", "avx512", "avx512vnni")


def skip_or_fail(kind: str | None, reason: str) -> None:
    """Skip a SIMD check whose runner is missing here, or fail it where $PYKVQ_REQUIRE_SIMD (comma-separated
    runner kinds, or "all"; .ci/run sets it) names its kind: in CI a missing runner is a failure, not a silent skip."""
    req = os.environ.get("PYKVQ_REQUIRE_SIMD", "")
    wanted = {k.strip() for k in req.split(",") if k.strip()}
    unknown = wanted - {*SIMD_KINDS, "all"}
    if unknown:
        pytest.fail(f"PYKVQ_REQUIRE_SIMD={req} names unknown kind(s) {sorted(unknown)}; known: {', '.join(SIMD_KINDS)}, all")
    if kind is not None and (kind in wanted or "all" in wanted):
        pytest.fail(f"{reason} (PYKVQ_REQUIRE_SIMD={req})")
    pytest.skip(reason)


def build_kind(flags: list[str], runner: str | None) -> str | None:
    """The runner kind a build needs: "neon" under qemu-aarch64, else its widest x86 ISA, None for scalar code."""
    if runner:
        return "neon"
    return next((k for f, k in KIND.items() if f in flags), None)


def _cpu_flags() -> str:
    try:
        return open("/proc/cpuinfo").read()
    except OSError:
        return ""


def run_check(check: str, cc: str, flags: list[str], runner: str | None, tmp_path: Path) -> int:
    """Compile native/tests/<check>.c with flags, run it (skip when the toolchain is missing, or after
    compiling when this CPU cannot run it; fail instead where $PYKVQ_REQUIRE_SIMD requires the build's kind),
    assert it passed, and return the number of kernel variants it tested."""
    kind = build_kind(flags, runner)
    if not shutil.which(cc) or (runner and not shutil.which(runner)):
        skip_or_fail(kind, f"{cc}{' / ' + runner if runner else ''} not installed (apt: gcc-aarch64-linux-gnu qemu-user)")
    src = REPO / "native"
    inc = [f"-I{src / 'include'}", f"-I{REPO / 'third_party/llama.cpp/ggml/include'}"]
    exe = tmp_path / check
    cmd = [cc, "-O2", "-std=c11", *flags, *inc, str(src / "tests" / f"{check}.c"),
           *(str(src / s) for s in SOURCES), "-lm", "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)   # compiled even where it cannot run
    if not runner:
        for flag, cpu in NEED.items():
            if flag in flags and cpu not in _cpu_flags():
                skip_or_fail(kind, f"compiled; this CPU lacks {cpu} to run it")
    run = [runner, "-L", "/usr/aarch64-linux-gnu", str(exe)] if runner else [str(exe)]
    res = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return int(re.search(r"impls (\d+)", res.stdout).group(1))
