"""--kv-window auto: the exact window's length chosen with the budget's types, for the context the user names
(issue 59, item 2).

A window counted in the budget (--kv-bits-ctx N) takes bits from the quantized cache: 16 x (sinks + W + 1) / N per
value. Which length pays best depends on the budget: SmolLM2 at 4096 tokens measured W 16 best at 3.0 bits (15%
below 64) and W 64 best at 3.5 (16 and 128 ~30% worse; docs/RESULTS-BY-DATE.md). Estimating it failed: the
backward pass's own objective and attention-read weights are taken on 512-token calibration sequences, where a
window makes a larger share of the reads exact than at N, and both ranked the lengths wrongly. So each length's
file is made and run at N tokens on the calibration text, and the one whose next-token distributions stay closest
to the unconverted model's f16 cache is kept.

The judge scores SEQS sequences of N tokens on their second half, as llama-perplexity does, taken right after the
calibration's own windows so that none of its tokens were fitted. Scoring only the last 512 positions of 2 was
tried first and misled: on SmolLM2 at 3.0 bits it ranked 64 < 32 < 16 on the calibration text, where WikiText-2
measures 16 < 32 < 64; per sequence the last 512 positions disagreed (one ranked 16 best by 45%), the second halves
of 3 sequences of either text all ranked 16 < 32 < 64. It keeps each row's TOP most likely tokens of the reference
(kilobytes, where whole rows of a 150k vocabulary are 0.6 GB per 1000); the KL divergence over those and the
rest's lumped mass is a lower bound of the full one (log-sum inequality) and equal to it when the rest is empty.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pykvq.metrics import log_softmax

from .gguf_io import ConvertError

WINDOWS = (16, 32, 64, 128, 256, 512)    # the lengths tried: those that leave the cache its cheapest types
SEQS = 3
TOP = 64
BLOCK = 16    # rows at a time: each float64 / int64 temporary of a 150k vocabulary ~20 MB
# The judge only prefills: without llama.cpp's repacked copy of the weights it holds the file's pages alone, and on
# AVX2 K-quants prefill faster (Qwen2.5-Coder-1.5B Q4_K_M 285 against 171 tokens/s on 2 cores; with the changes
# beside it a judged conversion took 278 s and 3.05 GiB peak RSS, not 403 s and 4.23 GiB: RESULTS-BY-DATE 2026-12-07).
REPACK = False
BATCH = 512   # tokens per decode call (the graph's own ubatch): 512 rows of logits at a time, 0.3 GB at 150k


def candidates(kv_bits: float, sinks: int, ctx: int, low_bits: float, row_type: str = "f16",
               heavy: float = 0.0) -> list[int]:
    """The WINDOWS whose rows (of row_type, with heavy's hitters) at ctx cells leave at least low_bits (the cheapest
    K and V types' mean) of kv_bits to the quantized cache, and that are at most an eighth of the context."""
    from pykvq.cache_info import window_bits
    return [w for w in WINDOWS if w <= ctx // 8 and kv_bits - window_bits(sinks, w, ctx, row_type, heavy) >= low_bits]


@dataclass
class Top:
    """Rows of a reference distribution: its TOP most likely tokens and their log-probabilities, and the
    log-probability of all the others together."""
    idx: np.ndarray        # [rows, k] int64
    logp: np.ndarray       # [rows, k] float64
    rest: np.ndarray       # [rows] float64 log of the remaining mass (-inf when none)

    def rows(self, a: int, b: int) -> "Top":
        return Top(self.idx[a:b], self.logp[a:b], self.rest[a:b])

    @staticmethod
    def join(parts: list) -> "Top":
        return Top(*(np.concatenate(x) for x in zip(*((p.idx, p.logp, p.rest) for p in parts))))


def _rest(lp: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """log of the mass outside idx per row, summed over those tokens themselves (-inf when there are none):
    1 - sum(top) would leave rounding where nothing is left."""
    masked = lp.copy()
    np.put_along_axis(masked, idx, -np.inf, axis=1)
    m = masked.max(axis=1)
    fin = np.isfinite(m)
    out = np.full(len(lp), -np.inf)
    out[fin] = m[fin] + np.log(np.exp(masked[fin] - m[fin, None]).sum(axis=1))
    return out


def top_of(logits: np.ndarray, k: int = TOP) -> Top:
    """The reference rows of logits [rows, vocab]."""
    parts = []
    for i in range(0, len(logits), BLOCK):
        lp = log_softmax(logits[i:i + BLOCK])
        kk = min(k, lp.shape[1])
        idx = np.argpartition(-lp, kk - 1, axis=1)[:, :kk]
        parts.append((idx, np.take_along_axis(lp, idx, axis=1), _rest(lp, idx)))
    return Top.join([Top(*p) for p in parts])


def kl_rows(ref: Top, logits: np.ndarray) -> np.ndarray:
    """KL(ref || softmax(logits)) per row over ref's tokens and the rest's lumped mass."""
    out = []
    for i in range(0, len(logits), BLOCK):
        idx, lp, rest = ref.idx[i:i + BLOCK], ref.logp[i:i + BLOCK], ref.rest[i:i + BLOCK]
        lq = log_softmax(logits[i:i + BLOCK])
        kl = (np.exp(lp) * (lp - np.take_along_axis(lq, idx, axis=1))).sum(axis=1)
        has = np.isfinite(rest)
        r = np.where(has, rest, 0.0)
        kl += np.where(has, np.exp(r) * (r - np.where(has, _rest(lq, idx), 0.0)), 0.0)
        out.append(kl)
    return np.maximum(np.concatenate(out), 0.0)


def sequences(tokens, n_calib: int, calib_len: int, n: int, length: int) -> list[list[int]]:
    """n sequences of length tokens between the calibration's n_calib windows (pykvq.calibrate.windows: evenly
    spread, calib_len long), none overlapping them: the first one after each window, then a second, ..."""
    tokens = list(tokens)
    stride = len(tokens) // max(n_calib, 1)
    gaps = [(i * stride + calib_len, (i + 1) * stride if i + 1 < n_calib else len(tokens)) for i in range(n_calib)]
    out = []
    for k in range(max((b - a) // length for a, b in gaps) if gaps else 0):
        for a, b in gaps:
            if a + (k + 1) * length <= b and len(out) < n:
                out.append(tokens[a + k * length:a + (k + 1) * length])
    if len(out) < n:
        raise ConvertError(f"--kv-window auto runs {n} sequences of {length} tokens (--kv-bits-ctx) beside the "
                           f"calibration's {n_calib} windows: the calibration text ({len(tokens)} tokens) is too "
                           "short; give a longer --calib text, a smaller --kv-bits-ctx, or a fixed --kv-window")
    return out


class Judge:
    """KL divergence of a converted file from the unconverted model's f16 cache on held-out calibration text."""

    def __init__(self, base_path, text: str, ctx: int, n_calib: int, calib_len: int, progress=None):
        from pykvq import Model
        from pykvq.progress import progress_bar
        self.ctx = ctx
        with Model(base_path, n_ctx=ctx, n_batch=BATCH, cache_type_k="f16", cache_type_v="f16", flash_attn=True,
                   repack_weights=REPACK) as m:
            toks = m.tokenize(text, add_special=False)
            self.seqs = sequences(toks, n_calib, calib_len - 1 if m.add_bos else calib_len, SEQS,
                                  ctx - 1 if m.add_bos else ctx)
            if m.add_bos:
                self.seqs = [[m.bos] + s for s in self.seqs]
            self.refs = [Top.join([top_of(x) for _, x in self._scored(m, s)])
                         for s in progress_bar(self.seqs, desc="window choice: reference", enable=progress)]
        self.rows = sum(len(r.idx) for r in self.refs)

    def _scored(self, m, seq):
        """(row offset, logits) of seq's scored positions (llama-perplexity's), a batch at a time."""
        from pykvq.metrics import scored_positions
        first, last = scored_positions(self.ctx)
        at = first
        for logits in m.iter_logits(seq, output_from=first, copy=False):    # each batch used before the next
            n = min(len(logits), last - at)
            if n > 0:
                yield at - first, logits[:n]
            at += len(logits)

    def kld(self, path) -> float:
        """Mean KL divergence over the judged rows of the file at path, read with its own types and window."""
        from pykvq import Model
        out = []
        with Model(path, n_ctx=self.ctx, n_batch=BATCH, flash_attn=True, repack_weights=REPACK) as m:
            for s, ref in zip(self.seqs, self.refs):
                out += [kl_rows(ref.rows(a, a + len(x)), x) for a, x in self._scored(m, s)]
        return float(np.concatenate(out).mean())
