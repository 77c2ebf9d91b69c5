"""CUDA without a GPU: the block codecs every CUDA kernel runs, built for the host and held to
the reference quantizers bit for bit; the kernels' own source (decode flash attention, SET_ROWS /
CPY / dequantize) run under a host emulation of CUDA threads against the references; and every CUDA translation
unit pykvq adds or patches
compiled by nvcc for sm_90 (ggml-cuda's flags), with the cuBLAS headers of the pinned
nvidia-cublas wheel. The checks that need a device are scripts/gpu_check.py (`make gpu-check`)."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NATIVE = REPO / "native"
GGML = REPO / "third_party" / "llama.cpp" / "ggml"

# every .cu of ours, and the upstream TUs the CUDA dispatch seam changes (the hooks, the 2-D rope factors)
CUDA_TUS = sorted(str(p) for p in (NATIVE / "ggml" / "cuda").glob("*.cu")) + [
    str(GGML / "src" / "ggml-cuda" / "ggml-cuda.cu"),
    str(GGML / "src" / "ggml-cuda" / "rope.cu"),
]


def test_codec_host_build_matches_reference(tmp_path):
    """kvq-codec.cuh compiled by g++: quantize bytes and dequantized bits equal the C
    reference (itself equal to the numpy one) for every type, codebook kind and edge case."""
    inc = [f"-I{NATIVE / 'include'}", f"-I{GGML / 'include'}"]
    exe = tmp_path / "cuda_codec_check"
    subprocess.run(["g++", "-O2", "-std=c++17", "-Wall", "-Werror", *inc, str(NATIVE / "tests" / "cuda_codec_check.cpp"),
                    *_reference_objects(tmp_path), "-lm", "-o", str(exe)], check=True, capture_output=True, text=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    checks = int(res.stdout.split()[1])
    assert checks > 10_000 and "failures 0" in res.stdout


def _reference_objects(tmp_path) -> list[str]:
    inc = [f"-I{NATIVE / 'include'}", f"-I{GGML / 'include'}"]
    objs = []
    for src in ("bfp.c", "nuq.c", "lsq.c", "q53.c", "tcq.c", "ggml-kvq.c", "kvq-validate.c"):
        obj = tmp_path / (src + ".o")
        subprocess.run(["gcc", "-O2", "-std=c11", *inc, "-c", str(NATIVE / "ggml" / src), "-o", str(obj)], check=True)
        objs.append(str(obj))
    return objs


def _run_emulated(tmp_path, name: str, expect: str) -> None:
    """Build native/tests/<name>.cpp against the host emulation (cuda_emu/ before native/ggml/cuda/ on the
    include path) and the reference codecs, run it, and look for its summary line."""
    inc = [f"-I{NATIVE / 'tests' / 'cuda_emu'}", f"-I{NATIVE / 'ggml' / 'cuda'}", f"-I{NATIVE / 'include'}", f"-I{GGML / 'include'}"]
    exe = tmp_path / name
    subprocess.run(["g++", "-O2", "-std=c++17", "-Wall", "-Wno-unknown-pragmas", "-Werror", *inc,
                    str(NATIVE / "tests" / f"{name}.cpp"), *_reference_objects(tmp_path), "-lm", "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert expect in res.stdout, res.stdout


def test_fattn_decode_kernel_emulated(tmp_path):
    """The decode kernel's own source (kvq-fattn.cuh) run on the host, then the split merge: each CUDA thread a fiber,
    shuffles and __syncthreads as barriers (native/tests/cuda_emu/common.cuh), against attention
    in double precision over the reference-dequantized K/V. 15 cases: every type as K and V,
    f16 / q8_0 K, head sizes 64 / 128 / 256, GQA 1 / 2 / 3 / 4 / 6 / 8 / 12 (two head blocks), 1 to 6
    splits, KV lengths off the tiles, 3 sequences with a per-sequence mask, masked keys, ALiBi,
    softcap, sinks, random nuq codebooks. A pre-RoPE K cache (kvq-prerope.cuh, 16 cases): the row
    transform in f32 and the prefill path's K -> f16 conversion (kvq-rows.cuh; f16 rows in place)
    against the read path in double (pykvq/ref/prerope.py's decode), within 1e-4 of each row's
    largest key below position ~1300 (measured 5e-5: ggml's float angles pos*w), 2e-3 at positions
    ~30000 (measured 1e-3), and 1e-4 of the reference at the float angles everywhere (measured 2e-7);
    the decode kernel's attention within 1e-4 (measured 6e-6; pairs with stock q4_0 and f16 V that
    only a pre-RoPE K takes included): NORM / NEOX, Hadamard 2 / 16 / 32 / 64 / 128 or none, partial rotary (96 of 128, 40 of 64), per-head frequencies, mscale, positions with
    a gap, a shifted block and one out of order, 2 streams, head sizes 64 / 128 / 256. Keys in halves (q53_64 /
    q42_64 / q32_64, 9 cases): rows and decode with the Hadamard that leaves out its stride-32 butterfly (a mutated skip fails
    the rows by 0.4 of the largest key). nuq3_64 / nuq2_64 values (4 cases): with themselves, q8_0 K and keys in halves. The exact window (decode 5 cases,
    prefill 4): its rows in f16 and in q8_0 (`--kv-window-type`; a wrong q8_0 row offset fails 3 of the 4 q8_0 cases)."""
    _run_emulated(tmp_path, "cuda_fattn_emu", "cases 60 failures 0")


def test_row_kernels_emulated(tmp_path):
    """SET_ROWS / CPY quantize and the dequantize kernel (kvq-rows.cuh), their own source under
    the host emulation: bytes equal to the reference quantizer at the rows the indices name (I64
    and I32, indices broadcast over dims 2 and 3, padded strides), other rows untouched, and the
    dequantized f32 / f16 equal to the reference dequantizer, for every type; stock q4_0 / q5_0 as a tagged
    SET_ROWS writes them (least-squares scales), against native/ggml/lsq.c; q53_64 / q42_64 / q32_64 against native/ggml/q53.c;
    nuq3_64 / nuq2_64 as the other nuq types; and for those five least-squares types the warp-per-block kernel CUDA launches (kvq_quantize_rows_lsq: lane k
    tries scale k), with NaN, inf, a zero block and a tie of |max| among the values (a scale off by one: 12 fail)."""
    _run_emulated(tmp_path, "cuda_rows_emu", "checks 99 failures 0")


def _nvcc_flags(cublas_inc: Path) -> list[str]:
    # what ggml-cuda's CMakeLists gives its TUs (CUDA_FLAGS, defines), for one Hopper arch
    return ["-std=c++17", "-arch=sm_90", "-use_fast_math", "-extended-lambda", "-O3", "-DNDEBUG",
            "-DGGML_KVQ", "-DGGML_CUDA_USE_GRAPHS", "-DGGML_SCHED_MAX_COPIES=4", "-Xcompiler", "-fPIC",
            f"-I{GGML / 'include'}", f"-I{GGML / 'src'}", f"-I{GGML / 'src' / 'ggml-cuda'}",
            f"-I{NATIVE / 'include'}", f"-I{cublas_inc}"]


@pytest.mark.skipif(not shutil.which("nvcc"), reason="nvcc not installed")
def test_cuda_sources_compile(tmp_path):
    """No GPU in CI: at least every CUDA TU pykvq adds or patches must compile (a full
    ggml-cuda build takes hours on 2 cores; these are the affected ones)."""
    sys.path.insert(0, str(REPO / "third_party"))
    import cuda_headers
    flags = _nvcc_flags(cuda_headers.include_dir())
    launcher = ["ccache"] if shutil.which("ccache") else []
    env = dict(os.environ, CCACHE_BASEDIR=str(REPO), CCACHE_NOHASHDIR="1")

    def compile_one(src: str) -> tuple[str, subprocess.CompletedProcess]:
        obj = tmp_path / (Path(src).name + ".o")
        cmd = [*launcher, "nvcc", *flags, "-c", src, "-o", str(obj)]
        return src, subprocess.run(cmd, capture_output=True, text=True, env=env)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(compile_one, CUDA_TUS))
    failed = [(Path(s).name, r.stderr[-3000:]) for s, r in results if r.returncode != 0]
    assert not failed, failed
    assert all((tmp_path / (Path(s).name + ".o")).stat().st_size > 0 for s in CUDA_TUS)
    # the decode kernels exist for every compiled pair and head size
    fattn = subprocess.run(["cuobjdump", "-symbols", str(tmp_path / "kvq-fattn-d128.cu.o")],
                           capture_output=True, text=True) if shutil.which("cuobjdump") else None
    if fattn is not None and fattn.returncode == 0:
        assert fattn.stdout.count("kvq_fattn_vec") >= 22, fattn.stdout[-2000:]


def test_gpu_check_plan_without_a_gpu(tmp_path):
    """scripts/gpu_check.py lists its steps and, with --dry-run, logs the prerope step's commands
    without running any: the pre-RoPE file fully offloaded (f16 and each setting), KLD on CPU, GPU and
    the GPU's post-RoPE cache, and llama-bench pre- and post-RoPE."""
    script = REPO / "scripts" / "gpu_check.py"
    res = subprocess.run([sys.executable, str(script), "--list"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "prerope" in res.stdout and "bench" in res.stdout, res.stderr
    model, pre, text = tmp_path / "m.gguf", tmp_path / "pre.gguf", tmp_path / "t.txt"
    res = subprocess.run([sys.executable, str(script), "--dry-run", "--steps", "prerope", "--model", str(model),
                          "--prerope-model", str(pre), "--text", str(text), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    cmds = [line.split("] ", 1)[1] for line in res.stdout.splitlines() if "/bin/llama-" in line]
    settings = re.search(r"^PREROPE_SETTINGS = (\[.*\])$", script.read_text(), re.M).group(1)
    n = len(ast.literal_eval(settings))
    completion = [c for c in cmds if "llama-completion" in c]
    assert len(completion) == 1 + n and all("-ngl 99" in c and str(pre) in c for c in completion)
    # the generations run the default domain: a pre-RoPE file's CUDA-held layers are pre-RoPE (checked from the log)
    assert not any(c.startswith("PYKVQ_K_DOMAIN") for c in completion)
    kld = [c for c in cmds if "llama-perplexity" in c]
    # base; per setting CPU, GPU, GPU in batches of 32, GPU post-RoPE; batches of 1 for UB1_SETTINGS; the bisection's
    # six extra runs of the first (CPU in batches of 32, graph reuse off, PDL off twice, blocking launches, batches of
    # 1 without CUDA graphs); the other key types in halves (HALVES_SETTINGS) as the settings, batches of 1 left out;
    # then q4_0 centred on CPU and GPU against the same base; then WINDOW_Q8_SETTINGS with q8_0 window rows on the
    # CPU, the GPU and the GPU in batches of 1
    ub1 = len(ast.literal_eval(re.search(r"^UB1_SETTINGS = (\[.*?\])", script.read_text(), re.M).group(1)))
    h = len(ast.literal_eval(re.search(r"^HALVES_SETTINGS = (\[.*?\])", script.read_text(), re.M).group(1)))
    w = len(ast.literal_eval(re.search(r"^WINDOW_Q8_SETTINGS = (\[.*?\])", script.read_text(), re.M).group(1)))
    assert len(kld) == 1 + 4*(n + h) + ub1 + 6 + 2 + 3*w
    assert sum("-ngl 0" in c for c in kld) == 1 + n + h + 1 + 1 + w
    assert sum(c.startswith("PYKVQ_K_DOMAIN=post") for c in kld) == n + h
    assert sum("-ub 32" in c for c in kld) == n + h + 4 and sum("-ub 1 " in c for c in kld) == ub1 + 1 + w
    assert sum(c.startswith("PYKVQ_K_DOMAIN=pre") for c in kld) == 3*(n + h) + ub1 + 6 + 3*w
    assert sum("PYKVQ_KV_WINDOW_TYPE=q8_0" in c for c in kld) == 3*w
    assert sum("-ctk q32_64" in c for c in kld) == 4
    assert sum("GGML_CUDA_PDL=0" in c for c in kld) == 2 and sum("LLAMA_GRAPH_REUSE_DISABLE=1" in c for c in kld) == 1
    assert sum(c.startswith("PYKVQ_K_DOMAIN=centred") for c in kld) == 2
    bench = [c for c in cmds if "llama-bench" in c]
    assert len(bench) == 1 + 2*n and all(str(pre) in c for c in bench)
    assert sum(c.startswith("PYKVQ_K_DOMAIN=post") for c in bench) == n and sum(c.startswith("PYKVQ_K_DOMAIN=pre") for c in bench) == n
    assert not (tmp_path / "out" / "gpu_check.json").exists()           # a dry run writes no results


def test_gguf_delta_rebuilds_a_derived_file(tmp_path):
    """scripts/gguf_delta.py (carrying a converted file to a lent GPU machine as a delta against its
    source model): the rebuilt file is byte for byte the derived one, the delta holds only what changed."""
    import numpy as np
    from gguf import GGUFWriter
    big = np.arange(4096, dtype=np.float32)

    def write(path, extra: bool):
        w = GGUFWriter(str(path), "llama")
        w.add_uint32("test.n", 7 if extra else 3)
        w.add_tensor("shared", big)
        w.add_tensor("changed", np.full(64, 2.0 if extra else 1.0, dtype=np.float32))
        if extra:
            w.add_tensor("blk.0.kvq_k_mean", np.ones(32, dtype=np.float32))
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    base, derived = tmp_path / "base.gguf", tmp_path / "derived.gguf"
    write(base, False)
    write(derived, True)
    script = REPO / "scripts" / "gguf_delta.py"
    for cmd in (["make", base, derived, tmp_path / "d"], ["apply", base, tmp_path / "d", tmp_path / "out.gguf"]):
        res = subprocess.run([sys.executable, str(script), *map(str, cmd)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
    assert (tmp_path / "out.gguf").read_bytes() == derived.read_bytes()
    assert (tmp_path / "d.bin").stat().st_size <= derived.stat().st_size - big.nbytes
    # the wrong base is caught
    res = subprocess.run([sys.executable, str(script), "apply", str(derived), str(tmp_path / "d"),
                          str(tmp_path / "bad.gguf")], capture_output=True, text=True)
    assert res.returncode != 0 and "sha256" in res.stderr and not (tmp_path / "bad.gguf").exists()
