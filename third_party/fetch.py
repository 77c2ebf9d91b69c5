#!/usr/bin/env python3
"""Fetch the pinned llama.cpp source and apply pykvq's hook patches.

The source is the ``vendor/llama.cpp`` tree of the ``llama-cpp-python`` sdist
named in ``llama.cpp.pin``.  It is downloaded with pip, checked against the
pinned sha256, extracted into ``third_party/llama.cpp/`` (git-ignored) and
patched with ``native/patches/*.patch`` in name order.

The patched tree is a small git repository: one commit ``upstream`` plus one
commit per patch, so ``refresh_patch.py`` can turn edits back into patches.
A stamp file records the sdist hash and the patch contents; when nothing
changed, re-running is a no-op.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PIN_FILE = HERE / "llama.cpp.pin"
PATCH_DIR = ROOT / "native" / "patches"
TREE = HERE / "llama.cpp"
CACHE = Path(os.environ.get("PYKVQ_SDIST_CACHE", HERE / ".cache"))
STAMP = ".pykvq-stamp"
PATCH_DATE = "2000-01-01T00:00:00Z"


class FetchError(RuntimeError):
    pass


def read_pin(path: Path = PIN_FILE) -> dict:
    pin = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, _, value = line.partition("=")
            pin[key.strip()] = value.strip()
    for key in ("package", "version", "sha256"):
        if key not in pin:
            raise FetchError(f"{path}: missing '{key}'")
    return pin


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def patch_message(patch: Path) -> str:
    """The commit message a patch file carries (git format-patch's Subject and body), else the file's name."""
    head = patch.read_text().split("\ndiff --git ", 1)[0]
    m = re.search(r"^Subject: (?:\[PATCH[^\]]*\] )?(.+)$", head, re.M)
    if m is None:
        return patch.name
    body = re.split(r"^---$", head[m.end():], maxsplit=1, flags=re.M)[0].strip("\n")
    return m.group(1) + ("\n\n" + body if body else "")


def patch_files(patch_dir: Path | None = None) -> list[Path]:
    return sorted((patch_dir or PATCH_DIR).glob("*.patch"))


def wanted_stamp(pin: dict, patches: list[Path]) -> str:
    lines = [f"sdist {pin['sha256']}"]
    lines += [f"patch {p.name} {sha256_file(p)}" for p in patches]
    return "\n".join(lines) + "\n"


def sdist_path(pin: dict) -> Path:
    name = pin["package"].replace("-", "_")
    return CACHE / f"{name}-{pin['version']}.tar.gz"


def download_sdist(pin: dict) -> Path:
    """Return the cached sdist, downloading it with pip when missing or bad."""
    path = sdist_path(pin)
    if path.exists() and sha256_file(path) == pin["sha256"]:
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        spec = f"{pin['package']}=={pin['version']}"
        print(f"fetch: downloading {spec} (sdist) with pip", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
               "--no-binary", ":all:", "--quiet", "-d", tmp, spec]
        res = subprocess.run(cmd)
        if res.returncode != 0:
            raise FetchError(f"pip download {spec} failed (exit {res.returncode})")
        got = list(Path(tmp).glob("*.tar.gz"))
        if len(got) != 1:
            raise FetchError(f"pip download {spec}: expected one .tar.gz, got {got}")
        digest = sha256_file(got[0])
        if digest != pin["sha256"]:
            raise FetchError(f"sha256 mismatch for {got[0].name}: got {digest}, "
                             f"pinned {pin['sha256']} in {PIN_FILE.name}")
        os.replace(got[0], path)
    return path


def git(tree: Path, *args: str, check: bool = True, capture: bool = False) -> str:
    # one author and date for every commit, so git format-patch writes the same patch files on every machine
    env = dict(os.environ, GIT_AUTHOR_NAME="pykvq", GIT_AUTHOR_EMAIL="pykvq@localhost",
               GIT_COMMITTER_NAME="pykvq", GIT_COMMITTER_EMAIL="pykvq@localhost",
               GIT_AUTHOR_DATE=PATCH_DATE, GIT_COMMITTER_DATE=PATCH_DATE)
    res = subprocess.run(["git", "-C", str(tree), *args], env=env, text=True,
                         stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    if check and res.returncode != 0:
        raise FetchError(f"git {' '.join(args)} failed:\n{res.stderr}")
    return res.stdout if capture else ""


def extract(sdist: Path, dest: Path) -> None:
    """Extract vendor/llama.cpp from the sdist into dest (fresh)."""
    prefix = None
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/", 1)
            # the sdist keeps a submodule's .git pointer file: never extract it
            if m.name.endswith("/.git") or "/.git/" in m.name:
                continue
            if len(parts) == 2 and parts[1].startswith("vendor/llama.cpp/"):
                prefix = parts[0] + "/vendor/llama.cpp/"
                members.append(m)
        if not members:
            raise FetchError(f"{sdist.name} holds no vendor/llama.cpp tree")
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            tar.extractall(tmp, members=members, filter="data")
            src = Path(tmp) / prefix
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(src, dest)


def apply_patches(tree: Path, patches: list[Path]) -> None:
    git(tree, "init", "-q")
    git(tree, "config", "core.autocrlf", "false")
    git(tree, "add", "-A", "-f")
    git(tree, "commit", "-q", "--no-verify", "-m", "upstream")
    git(tree, "tag", "upstream")
    # the stamp is ours, not part of any patch: keep it out of `git add -A`
    with open(tree / ".git" / "info" / "exclude", "a") as f:
        f.write(f"\n{STAMP}\n")
    for p in patches:
        res = subprocess.run(["git", "-C", str(tree), "apply", "--whitespace=nowarn", str(p)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise FetchError(f"patch {p.name} does not apply:\n{res.stderr.strip()}")
        git(tree, "add", "-A", "-f")
        git(tree, "commit", "-q", "--no-verify", "--allow-empty", "-m", patch_message(p))
        print(f"fetch: applied {p.name}", flush=True)


def tree_is_dirty(tree: Path) -> bool:
    if not (tree / ".git").is_dir():
        return False
    return bool(git(tree, "status", "--porcelain", "--untracked-files=no", capture=True).strip())


def _show(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def fetch(force: bool = False, tree: Path | None = None) -> Path:
    tree = tree or TREE
    pin = read_pin()
    patches = patch_files()
    stamp = wanted_stamp(pin, patches)
    stamp_file = tree / STAMP
    if not force and stamp_file.exists() and stamp_file.read_text() == stamp:
        print(f"fetch: {_show(tree)} is up to date "
              f"({pin['package']} {pin['version']}, {len(patches)} patches)")
        return tree
    if tree_is_dirty(tree) and not force:
        raise FetchError(
            f"{tree} has local edits and the patches changed; save them with "
            "third_party/refresh_patch.py or re-run with --force to discard them")
    sdist = download_sdist(pin)
    tree.parent.mkdir(parents=True, exist_ok=True)
    extract(sdist, tree)
    apply_patches(tree, patches)
    stamp_file.write_text(stamp)
    print(f"fetch: {_show(tree)} ready ({pin['package']} {pin['version']}, "
          f"{len(patches)} patches)")
    return tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true",
                    help="re-extract and re-patch even if up to date (discards local edits)")
    ap.add_argument("--print-sdist", action="store_true",
                    help="download and check the pinned sdist if needed, print its path, extract nothing")
    args = ap.parse_args(argv)
    try:
        if args.print_sdist:
            print(download_sdist(read_pin()))
            return 0
        fetch(force=args.force)
    except FetchError as e:
        print(f"fetch: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
