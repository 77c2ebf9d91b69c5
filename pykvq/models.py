"""The old name of pykvq.registry (fetch, MODELS, model_path, ...) and of pykvq.paths.cache_dir.

Kept so that existing `from pykvq.models import fetch` lines keep working; new code imports
pykvq.registry and pykvq.paths. materialize_hf moved to the converter (convert/hf_checkpoint.py).
"""
from .paths import cache_dir
from .registry import DEFAULT_MODEL, MODELS, ModelSpec, default_model_path, fetch, model_path

__all__ = ["cache_dir", "DEFAULT_MODEL", "MODELS", "ModelSpec", "default_model_path", "fetch", "model_path"]
