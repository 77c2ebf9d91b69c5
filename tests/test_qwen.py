"""Qwen2.5-Coder-1.5B (1.1 GB): run with PYKVQ_TEST_QWEN=1."""
from __future__ import annotations

import pytest

from pykvq import Model

pytestmark = pytest.mark.qwen


@pytest.fixture(scope="module")
def qwen():
    from pykvq.models import fetch
    return fetch("qwen2.5-coder-1.5b")


def test_qwen_writes_python(qwen):
    with Model(qwen, n_ctx=1024) as m:
        assert m.arch == "qwen2" and m.head_dim_k == 128 and m.n_head_kv == 2
        out = m.generate("Write a Python function that returns the square of x.", max_tokens=64)
        assert "def " in out and "return" in out


def test_qwen_q8_0_kld_is_small(qwen, passage):
    with Model(qwen, n_ctx=512) as base, \
            Model(qwen, n_ctx=512, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn=True) as q8:
        r = q8.kl_divergence(passage, baseline=base, n_ctx=512, n_chunks=1)
        assert 0 < r.mean_kld < 0.05, r
