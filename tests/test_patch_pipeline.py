"""The pinned source + patch pipeline: fresh extract, idempotence, loud failures, refresh."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "third_party"))
import fetch  # noqa: E402
import refresh_patch  # noqa: E402


@pytest.fixture()
def patch_env(tmp_path, monkeypatch):
    """A copy of native/patches and an empty tree location, so tests never touch the real tree."""
    patches = tmp_path / "patches"
    shutil.copytree(fetch.PATCH_DIR, patches)
    monkeypatch.setattr(fetch, "PATCH_DIR", patches)
    monkeypatch.setattr(fetch, "ROOT", tmp_path)
    return tmp_path / "llama.cpp", patches


def test_pin_is_exact():
    pin = fetch.read_pin()
    assert pin["package"] == "llama-cpp-python" and pin["version"] == "0.3.36"
    assert len(pin["sha256"]) == 64


def test_fresh_extract_applies_all_patches_and_rerun_is_noop(patch_env, capsys):
    tree, patches = patch_env
    fetch.fetch(tree=tree)
    log = fetch.git(tree, "log", "--format=%B%x00", capture=True).split("\0")
    want = [fetch.patch_message(p) for p in fetch.patch_files(patches)][::-1] + ["upstream"]
    assert [m.strip() for m in log if m.strip()] == want
    # the first hook is in place
    assert "GGML_KVQ_DIR" in (tree / "ggml/src/CMakeLists.txt").read_text()
    assert "ggml_kvq_version" in (tree / "src/llama.cpp").read_text()
    capsys.readouterr()
    mtime = (tree / "src/llama.cpp").stat().st_mtime_ns
    fetch.fetch(tree=tree)
    assert "up to date" in capsys.readouterr().out
    assert (tree / "src/llama.cpp").stat().st_mtime_ns == mtime


def test_patch_that_does_not_apply_fails_with_its_name(patch_env):
    tree, patches = patch_env
    (patches / "0999-broken.patch").write_text(
        "--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -1,1 +1,1 @@\n-this line is not there\n+x\n")
    with pytest.raises(fetch.FetchError, match="0999-broken.patch"):
        fetch.fetch(tree=tree)


def test_refresh_patch_round_trip(patch_env):
    tree, patches = patch_env
    fetch.fetch(tree=tree)
    f = tree / "src/llama.cpp"
    f.write_text(f.read_text() + "// pykvq test edit\n")
    changed = refresh_patch.refresh("0998-test-edit.patch", tree=tree, patch_dir=patches)
    assert changed == ["0998-test-edit.patch"]
    assert "+// pykvq test edit" in (patches / "0998-test-edit.patch").read_text()
    # the stamp file is bookkeeping, never part of a patch
    assert not any(fetch.STAMP in p.read_text() for p in patches.glob("*.patch"))
    # the stamp now matches: no re-extract; a fresh extract reproduces the edit
    assert (tree / fetch.STAMP).read_text() == fetch.wanted_stamp(fetch.read_pin(), fetch.patch_files(patches))
    fetch.fetch(tree=tree, force=True)
    assert f.read_text().endswith("// pykvq test edit\n")


def test_patches_are_one_per_seam_with_a_message(patch_env):
    """Issue 60's shape: at most 10 patches, each a git format-patch file whose message says what its seam is for,
    no upstream file in two of them (so none edits another's lines), and a fresh tree writes them back
    byte for byte (refresh_patch's format is deterministic)."""
    tree, patches = patch_env
    files = fetch.patch_files(patches)
    assert 1 <= len(files) <= 10
    owner = {}
    for p in files:
        msg = fetch.patch_message(p)
        subject, _, body = msg.partition("\n\n")
        assert subject.startswith("kvq: ") and len(body.split()) >= 15, p.name
        for line in p.read_text().splitlines():
            if line.startswith("diff --git a/"):
                path = line.split()[2][2:]
                assert path not in owner, f"{path} is patched by {owner.get(path)} and {p.name}"
                owner[path] = p.name
    fetch.fetch(tree=tree)
    before = {p.name: p.read_text() for p in files}
    names = [p.name for p in files]
    assert refresh_patch.write_patches(tree, patches, names) == []
    assert {p.name: p.read_text() for p in fetch.patch_files(patches)} == before
