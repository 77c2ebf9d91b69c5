#!/usr/bin/env python3
"""Train the trellis tables (pykvq/ref/tcq.py TABLES, native/ggml/tcq-tables.h): levels A[s >> 4] + B[s & 15] for
the 256 trellis states, fitted to unit-RMS Gaussian blocks (what the online Hadamard makes of a cache row).

    python scripts/tcq_tables.py [2 | 3 | 25 | 35 ...]      (default: all four)

25 is tcq25_64, whose even values take 3 bits and odd values 2 (35: tcq35_64, 4 and 3): one pair of tables per
parity, fitted together.
Lloyd's alternation on the trellis: the encoder's paths for the current levels (the rule's two Viterbi passes), then
new levels from the values each state took: five rounds with all levels free (from a random Gaussian start),
then twenty fitting A and B by least squares. The tables are rounded to 1/4096, which a float32 holds exactly.
Prints the tables and the squared error on fresh blocks (they are the ones in the code); ~3 min a type on 2 cores.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pykvq.ref import tcq  # noqa: E402

KINDS = {"2": 2, "3": 3, "25": (3, 2), "35": (4, 3)}


def paths(z: np.ndarray, k, lut: np.ndarray) -> np.ndarray:
    free = tcq.viterbi(z, k, lut, None, tcq.N // 2)
    return tcq.viterbi(z, k, lut, free[:, tcq.N // 2 - 1] >> tcq.steps(k)[0][0], 0)


def main() -> int:
    rng = np.random.default_rng(11)

    def blocks(n: int) -> np.ndarray:
        x = rng.standard_normal((n, tcq.N))
        return (x / np.sqrt((x ** 2).mean(1, keepdims=True))).astype(np.float32)

    s = np.arange(tcq.STATES)
    M = np.zeros((tcq.STATES, 32))
    M[s, s >> 4] = 1
    M[s, 16 + (s & 15)] = 1
    for name in sys.argv[1:] or list(KINDS):
        k = KINDS[name]
        npar = 2 if isinstance(k, tuple) else 1          # tables: one per parity of the value
        x = blocks(6000)
        lut = np.stack([np.sort(rng.standard_normal(tcq.STATES))[rng.permutation(tcq.STATES)] for _ in range(npar)])
        sol = np.zeros((npar, 32))
        for it in range(25):
            st = paths(x, k, lut.astype(np.float32) if npar == 2 else lut[0].astype(np.float32))
            for c in range(npar):
                sc, xc = st[:, c::npar].ravel(), x[:, c::npar].ravel()
                cnt = np.bincount(sc, minlength=tcq.STATES).astype(float)
                sm = np.bincount(sc, weights=xc, minlength=tcq.STATES)
                if it < 5:
                    lut[c] = np.where(cnt > 0, sm / np.maximum(cnt, 1), lut[c])
                else:
                    sol[c] = np.linalg.solve(M.T @ (cnt[:, None] * M) + 1e-9 * np.eye(32), M.T @ sm)
                    lut[c] = M @ sol[c]
        t = []
        for c in range(npar):
            a, b = sol[c, :16] + sol[c, 16:].mean(), sol[c, 16:] - sol[c, 16:].mean()
            t += [int(v) for v in np.round(np.concatenate([a, b]) * 4096)]
        xt = blocks(4000)
        lv = tcq.levels(k, t)
        err = float(((xt - tcq.read(k, lv, paths(xt, k, lv))) ** 2).mean())
        print(f"{name}: squared error {err:.4f} on unit Gaussian blocks")
        for c in range(npar):
            print(f"  A {t[32 * c:32 * c + 16]}\n  B {t[32 * c + 16:32 * c + 32]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
