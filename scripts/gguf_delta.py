#!/usr/bin/env python3
"""A GGUF as a small delta against another: carry a converted file to a machine that already has
its source model (a lent GPU machine takes 64 MiB per call) without sending the shared tensors twice.

    python scripts/gguf_delta.py make  BASE DERIVED OUT     # OUT.bin + OUT.json
    python scripts/gguf_delta.py apply BASE OUT DERIVED     # standard library only (no gguf-py there)

The delta holds DERIVED's header and the tensors whose bytes differ from BASE's tensor of the same
name; apply rebuilds DERIVED byte for byte and checks its sha256.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path


def _raw(f, off: int, n: int) -> bytes:
    f.seek(off)
    return f.read(n)


def make(base: Path, derived: Path, out: Path) -> int:
    from gguf import GGUFReader
    b, d = GGUFReader(base), GGUFReader(derived)
    by_name = {t.name: t for t in b.tensors}
    with open(base, "rb") as fb, open(derived, "rb") as fd:
        start = min((t.data_offset for t in d.tensors), default=os.path.getsize(derived))
        blob = bytearray(_raw(fd, 0, start))
        plan = []
        for t in d.tensors:
            data = _raw(fd, t.data_offset, t.n_bytes)
            o = by_name.get(t.name)
            if o is not None and o.n_bytes == t.n_bytes and _raw(fb, o.data_offset, o.n_bytes) == data:
                plan.append([t.data_offset, t.n_bytes, "base", o.data_offset])
            else:
                plan.append([t.data_offset, t.n_bytes, "delta", len(blob)])
                blob += data
    sha = hashlib.sha256(derived.read_bytes()).hexdigest()
    Path(f"{out}.bin").write_bytes(blob)
    Path(f"{out}.json").write_text(json.dumps({"size": os.path.getsize(derived), "header": start,
                                               "sha256": sha, "tensors": plan}))
    return len(blob)


def apply(base: Path, delta: Path, out: Path) -> None:
    man = json.loads(Path(f"{delta}.json").read_text())
    blob = Path(f"{delta}.bin").read_bytes()
    buf = bytearray(man["size"])          # gaps between tensors are GGUF's zero padding
    buf[:man["header"]] = blob[:man["header"]]
    with open(base, "rb") as fb:
        for off, n, src, at in man["tensors"]:
            buf[off:off + n] = _raw(fb, at, n) if src == "base" else blob[at:at + n]
    if hashlib.sha256(buf).hexdigest() != man["sha256"]:
        raise SystemExit(f"gguf_delta: {out} does not match the delta's sha256 (wrong base file?)")
    tmp = Path(f"{out}.tmp")
    tmp.write_bytes(buf)
    tmp.replace(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="BASE DERIVED OUT: write OUT.bin and OUT.json")
    m.add_argument("base", type=Path); m.add_argument("derived", type=Path); m.add_argument("out")
    a = sub.add_parser("apply", help="BASE DELTA OUT: rebuild the derived file")
    a.add_argument("base", type=Path); a.add_argument("delta"); a.add_argument("out", type=Path)
    args = ap.parse_args()
    if args.cmd == "make":
        n = make(args.base, args.derived, args.out)
        print(f"{args.out}.bin: {n} bytes (of {os.path.getsize(args.derived)})")
    else:
        apply(args.base, args.delta, args.out)
        print(f"{args.out}: rebuilt, sha256 checked")


if __name__ == "__main__":
    main()
