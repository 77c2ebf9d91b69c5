#!/usr/bin/env python3
"""Turn edits in third_party/llama.cpp back into native/patches/*.patch.

One patch per upstream seam (native/README.md maps seam -> patch -> our files), each a git format-patch file whose
message says what the seam is for. Edit the patched tree, then:

    python third_party/refresh_patch.py 0008-kvq-kv-cache.patch            # fold edits into that seam's patch
    python third_party/refresh_patch.py 0011-kvq-new-seam.patch -m "kvq: ..."   # edits become a new last patch

fetch.py keeps the tree as a git repository with one commit per patch (in name order, the patch's message as
the commit's), so an edit is committed as a fixup of its patch's commit, the series is rebased, and every patch
file is rewritten from its commit. The stamp is updated, so the next fetch/build sees the tree as current and
does not re-extract it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fetch  # noqa: E402
from fetch import FetchError, git  # noqa: E402


def patch_commits(tree: Path, names: list[str]) -> list[tuple[str, str]]:
    """(commit, patch name) for each patch commit, oldest first: the n-th commit after upstream is the n-th patch."""
    out = git(tree, "log", "--reverse", "--format=%H", "upstream..HEAD", capture=True)
    commits = [line.strip() for line in out.splitlines() if line.strip()]
    if len(commits) != len(names):
        raise FetchError(f"the tree has {len(commits)} patch commits for {len(names)} patch files; "
                         "re-run third_party/fetch.py --force (local edits are lost)")
    return list(zip(commits, names))


def format_patch(tree: Path, commit: str) -> str:
    return git(tree, "format-patch", "-1", "--stdout", "--zero-commit", "--no-signature", "--no-numbered",
               commit, capture=True)


def write_patches(tree: Path, patch_dir: Path, names: list[str]) -> list[str]:
    changed = []
    for commit, name in patch_commits(tree, names):
        text = format_patch(tree, commit)
        path = patch_dir / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(name)
    return changed


def refresh(name: str, tree: Path | None = None, patch_dir: Path | None = None,
            paths: list[str] | None = None, message: str | None = None) -> list[str]:
    tree, patch_dir = tree or fetch.TREE, patch_dir or fetch.PATCH_DIR
    if not name.endswith(".patch") or "/" in name:
        raise FetchError(f"patch name must look like 0002-what-it-hooks.patch, got {name!r}")
    if not (tree / ".git").exists():
        raise FetchError(f"{tree} is not a fetched tree; run third_party/fetch.py first")
    names = [p.name for p in fetch.patch_files(patch_dir)]
    commits = dict((n, c) for c, n in patch_commits(tree, names))
    git(tree, "add", "-A", "--", *(paths or ["."]))
    if not git(tree, "diff", "--cached", "--name-only", capture=True).strip():
        raise FetchError("no edits in the tree to save")
    if name in commits:
        git(tree, "commit", "-q", "--no-verify", "--fixup", commits[name])
        git(tree, "-c", "sequence.editor=true", "rebase", "-q", "-i", "--autosquash", "--autostash",
            f"{commits[name]}~1")
    else:
        last = max(commits, default="")
        if name < last:
            raise FetchError(f"new patch {name} would not sort after {last}; pick a later number")
        git(tree, "commit", "-q", "--no-verify", "-m", message or f"kvq: {name[:-len('.patch')].split('-', 1)[-1]}")
        names.append(name)
    changed = write_patches(tree, patch_dir, names)
    (tree / fetch.STAMP).write_text(fetch.wanted_stamp(fetch.read_pin(), fetch.patch_files(patch_dir)))
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("patch", help="patch file name in native/patches (existing or new)")
    ap.add_argument("paths", nargs="*", help="only these paths of the tree (default: every edit)")
    ap.add_argument("-m", "--message", help="a new patch's message: what its seam is for (subject, blank line, body)")
    args = ap.parse_args(argv)
    try:
        changed = refresh(args.patch, paths=args.paths, message=args.message)
    except FetchError as e:
        print(f"refresh_patch: error: {e}", file=sys.stderr)
        return 1
    for n in changed:
        print(f"refresh_patch: wrote native/patches/{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
