"""An HF-format checkpoint dequantized from a GGUF, for calibration (transformers runs it).

``hf_checkpoint(gguf)`` is the one the converter, the tests and the studies share, cached in
``cached_dir(gguf)`` under pykvq.paths.cache_dir() / "hf"; ``materialize_hf(gguf, dir)`` writes one anywhere.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from pykvq.paths import cache_dir


def cached_dir(gguf: str | os.PathLike) -> Path:
    """Where hf_checkpoint keeps gguf's checkpoint: one per file name and size."""
    gguf = Path(gguf)
    return cache_dir() / "hf" / f"{gguf.stem}-{gguf.stat().st_size}"


def hf_checkpoint(gguf: str | os.PathLike) -> Path:
    """The HF checkpoint of gguf in the user's cache, written on first use."""
    return materialize_hf(gguf, cached_dir(gguf))


def materialize_hf(gguf: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32",
                   force: bool = False) -> Path:
    """Write an HF-format checkpoint (config.json, model.safetensors, tokenizer)
    dequantized from a GGUF, via transformers' GGUF loader.

    transformers refuses save_pretrained() on GGUF-loaded models, so the state
    dict is written with safetensors and quantization_config is dropped.
    The directory is built in a temp dir and moved into place at the end.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf).resolve()
    out = Path(out_dir)
    if (out / "config.json").exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        tmp = Path(tmp)
        kw = dict(gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, torch_dtype=getattr(torch, dtype), **kw)
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.torch_dtype = dtype
        config.architectures = [type(model).__name__]   # upstream's converter picks its model class by this
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        sp = tmp / "tokenizer.model"    # transformers copies the GGUF itself here; it is no sentencepiece model
        if sp.exists() and sp.read_bytes()[:4] == b"GGUF":
            sp.unlink()
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        tmp.mkdir()  # TemporaryDirectory wants something to clean up
    return out
