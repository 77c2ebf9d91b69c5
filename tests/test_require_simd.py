"""$PYKVQ_REQUIRE_SIMD (.ci/run sets it): a SIMD check whose runner is missing fails for a required kind, skips otherwise."""
from __future__ import annotations

import pytest

from native_build import build_kind, skip_or_fail


def test_required_kind_fails_the_others_skip(monkeypatch):
    monkeypatch.setenv("PYKVQ_REQUIRE_SIMD", "neon")
    with pytest.raises(pytest.fail.Exception, match=r"no qemu \(PYKVQ_REQUIRE_SIMD=neon\)"):
        skip_or_fail("neon", "no qemu")
    with pytest.raises(pytest.skip.Exception, match="no avx512bw"):
        skip_or_fail("avx512", "no avx512bw")
    with pytest.raises(pytest.skip.Exception):
        skip_or_fail(None, "gcc not installed")          # scalar code: never a SIMD runner


def test_unset_skips_every_kind(monkeypatch):
    monkeypatch.delenv("PYKVQ_REQUIRE_SIMD", raising=False)
    for kind in ("neon", "avx512"):
        with pytest.raises(pytest.skip.Exception):
            skip_or_fail(kind, "missing")


def test_all_and_lists(monkeypatch):
    monkeypatch.setenv("PYKVQ_REQUIRE_SIMD", "all")
    with pytest.raises(pytest.fail.Exception):
        skip_or_fail("avx512vnni", "missing")
    monkeypatch.setenv("PYKVQ_REQUIRE_SIMD", "neon, avx2")
    with pytest.raises(pytest.fail.Exception):
        skip_or_fail("avx2", "missing")
    with pytest.raises(pytest.skip.Exception):
        skip_or_fail("avx512", "missing")
    monkeypatch.setenv("PYKVQ_REQUIRE_SIMD", "avx-512")           # a typo fails loudly instead of requiring nothing
    with pytest.raises(pytest.fail.Exception, match="unknown kind"):
        skip_or_fail("avx512", "missing")


@pytest.mark.parametrize("flags,runner,kind", [(["-march=armv8-a"], "qemu-aarch64", "neon"),
                                               (["-march=x86-64"], None, None),
                                               (["-march=haswell"], None, "avx2"),
                                               (["-mavx2", "-mfma", "-mf16c"], None, "avx2"),
                                               (["-mavx2", "-mavx512f", "-mavx512bw"], None, "avx512"),
                                               (["-mavx2", "-mavx512f", "-mavx512vnni"], None, "avx512vnni")])
def test_build_kind(flags, runner, kind):
    assert build_kind(flags, runner) == kind
