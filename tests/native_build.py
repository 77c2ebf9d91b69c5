"""Build a standalone native/tests/*_check.c for one ISA (cross-compiled and run under qemu
for aarch64) and run it: the kernel variants this machine does not select get tested too."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# cpu/kvq-dispatch.c hands each type to its family's kernels (cpu/bfp-cpu.c, cpu/nuq-cpu.c, cpu/q53-cpu.c): every check links them all
SOURCES = [f"ggml/{s}" for s in ("cpu/kvq-dispatch.c", "cpu/bfp-cpu.c", "cpu/nuq-cpu.c", "cpu/q53-cpu.c", "cpu/lsq-cpu.c", "bfp.c", "nuq.c", "q53.c", "lsq.c",
                                  "ggml-kvq.c")]   # under native/
# compiler flag -> the /proc/cpuinfo flag a native x86 run needs
NEED = {"-mavx512vnni": "avx512_vnni", "-mavx512f": "avx512bw", "-mavx2": "avx2"}


def _cpu_flags() -> str:
    try:
        return open("/proc/cpuinfo").read()
    except OSError:
        return ""


def run_check(check: str, cc: str, flags: list[str], runner: str | None, tmp_path: Path) -> int:
    """Compile native/tests/<check>.c with flags, run it (skip when the toolchain is missing, or after
    compiling when this CPU cannot run it), assert it passed, and return the number of kernel variants it tested."""
    if not shutil.which(cc) or (runner and not shutil.which(runner)):
        pytest.skip(f"{cc}{' / ' + runner if runner else ''} not installed (apt: gcc-aarch64-linux-gnu qemu-user)")
    src = REPO / "native"
    inc = [f"-I{src / 'include'}", f"-I{REPO / 'third_party/llama.cpp/ggml/include'}"]
    exe = tmp_path / check
    cmd = [cc, "-O2", "-std=c11", *flags, *inc, str(src / "tests" / f"{check}.c"),
           *(str(src / s) for s in SOURCES), "-lm", "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)   # compiled even where it cannot run
    if not runner:
        for flag, cpu in NEED.items():
            if flag in flags and cpu not in _cpu_flags():
                pytest.skip(f"compiled; this CPU lacks {cpu} to run it")
    run = [runner, "-L", "/usr/aarch64-linux-gnu", str(exe)] if runner else [str(exe)]
    res = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return int(re.search(r"impls (\d+)", res.stdout).group(1))
