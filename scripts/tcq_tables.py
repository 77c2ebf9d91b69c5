#!/usr/bin/env python3
"""Train the tcq3_64 / tcq2_64 tables (pykvq/ref/tcq.py TABLES, native/ggml/tcq.c): levels A[s >> 4] + B[s & 15]
for the 256 trellis states, fitted to unit-RMS Gaussian blocks (what the online Hadamard makes of a cache row).

    python scripts/tcq_tables.py

Lloyd's alternation on the trellis: the encoder's paths for the current levels (the rule's two Viterbi passes), then
new levels from the values each state took: five rounds with all 256 levels free (from a random Gaussian start),
then twenty fitting A and B by least squares. The tables are rounded to 1/4096, which a float32 holds exactly.
Prints both tables and the squared error on fresh blocks (they are the ones in the code); ~3 min on 2 cores.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pykvq.ref import tcq  # noqa: E402


def paths(z: np.ndarray, k: int, lut: np.ndarray) -> np.ndarray:
    free = tcq.viterbi(z, k, lut, None, tcq.N // 2)
    return tcq.viterbi(z, k, lut, free[:, tcq.N // 2 - 1] >> k, 0)


def main() -> int:
    rng = np.random.default_rng(11)

    def blocks(n: int) -> np.ndarray:
        x = rng.standard_normal((n, tcq.N))
        return (x / np.sqrt((x ** 2).mean(1, keepdims=True))).astype(np.float32)

    s = np.arange(tcq.STATES)
    M = np.zeros((tcq.STATES, 32))
    M[s, s >> 4] = 1
    M[s, 16 + (s & 15)] = 1
    for k in (2, 3):
        x = blocks(6000)
        lut = np.sort(rng.standard_normal(tcq.STATES))[rng.permutation(tcq.STATES)]
        for it in range(25):
            st = paths(x, k, lut.astype(np.float32)).ravel()
            cnt = np.bincount(st, minlength=tcq.STATES).astype(float)
            sm = np.bincount(st, weights=x.ravel(), minlength=tcq.STATES)
            if it < 5:
                lut = np.where(cnt > 0, sm / np.maximum(cnt, 1), lut)
            else:
                sol = np.linalg.solve(M.T @ (cnt[:, None] * M) + 1e-9 * np.eye(32), M.T @ sm)
                lut = M @ sol
        a, b = sol[:16] + sol[16:].mean(), sol[16:] - sol[16:].mean()
        t = [int(v) for v in np.round(np.concatenate([a, b]) * 4096)]
        xt = blocks(4000)
        lv = tcq.levels(k, t)
        print(f"k = {k}: squared error {float(((xt - lv[paths(xt, k, lv)]) ** 2).mean()):.4f} on unit Gaussian blocks")
        print(f"  A {t[:16]}\n  B {t[16:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
