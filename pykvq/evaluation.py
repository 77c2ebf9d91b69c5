"""Quality of a Model against a baseline: perplexity, base-logits files, KL divergence.

The chunking and scoring follow llama-perplexity (pykvq/metrics.py holds the pure-numpy metrics).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .errors import ContextOverflowError, PykvqError
from .metrics import KLDAccumulator, KLDResult, LogDist, PerplexityResult, scored_positions
from .logits_file import LogitsFile, LogitsWriter
from .progress import progress_bar


# A Model used as a KLD baseline keeps the distributions of the chunks it evaluated, least recently used dropped
# first past this many bytes (float32 logits: ~50 MB a 512-token chunk of a 50k vocabulary), so that comparing
# several models one kl_divergence call at a time evaluates the baseline once per chunk, not once per call. A chunk
# past this size is not held at all: the baseline and the models are decoded side by side (kld_sweep).
BASELINE_MEMO_BYTES = int(os.environ.get("PYKVQ_BASELINE_MEMO_MB", "512")) << 20


class Evaluation:
    """Model's perplexity / save_logits / kl_divergence (a mixin: Model supplies tokenize, eval_logits,
    n_ctx, n_vocab, add_bos, bos and the cache type names)."""

    def _baseline_chunk(self, chunk: np.ndarray) -> LogDist:
        """This model's distributions over a chunk's scored positions, as a baseline (memoized: evaluation from an
        empty cache is deterministic for a given model, settings and tokens)."""
        memo = self.__dict__.setdefault("_baseline_memo", OrderedDict())
        key = np.asarray(chunk, dtype=np.int32).tobytes()
        if key in memo:
            memo.move_to_end(key)
            return memo[key]
        d = LogDist.of_logits(self._chunk_logits(chunk))
        memo[key] = d
        while len(memo) > 1 and sum(v.x.nbytes for v in memo.values()) > BASELINE_MEMO_BYTES:
            memo.popitem(last=False)
        return d

    def _check_eval_ctx(self, n_ctx: int) -> None:
        if n_ctx > self.n_ctx:
            raise ContextOverflowError(
                f"evaluation context {n_ctx} exceeds the model's context {self.n_ctx}; "
                f"create the Model with n_ctx >= {n_ctx}")
        if n_ctx < 4:
            raise ValueError("n_ctx must be at least 4")

    def _chunks(self, text: str | None, tokens, n_ctx: int, n_chunks: int | None) -> tuple[np.ndarray, int]:
        self._check_eval_ctx(n_ctx)
        if tokens is None:
            tokens = self.tokenize(text, add_special=True, parse_special=False)
        tokens = np.asarray(tokens, dtype=np.int32)
        n_max = len(tokens) // n_ctx
        if n_max < 1:
            raise ContextOverflowError(
                f"the text is {len(tokens)} tokens; at least {n_ctx} are needed for one chunk of {n_ctx}")
        n = n_max if n_chunks is None else min(n_chunks, n_max)
        return tokens, n

    def _chunk_logits(self, chunk: np.ndarray) -> np.ndarray:
        toks = chunk.tolist()
        if self.add_bos:
            toks[0] = self.bos
        first, _ = scored_positions(len(toks))
        return self.eval_logits(toks, output_from=first)[:-1]

    def perplexity(self, text: str | None = None, n_ctx: int = 512, n_chunks: int | None = None, *,
                   tokens=None, progress: bool | None = None) -> PerplexityResult:
        """Perplexity over chunks of n_ctx tokens, scored like llama-perplexity."""
        tokens, n = self._chunks(text, tokens, n_ctx, n_chunks)
        first, last = scored_positions(n_ctx)
        nlls = []
        for i in progress_bar(range(n), desc=f"perplexity {self.cache_type_k}/{self.cache_type_v}",
                              enable=progress):
            chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
            targets = chunk[first + 1:last + 1]
            for r, (x,) in _side_by_side([self], chunk, first, last - first):
                nlls.append(LogDist.of_logits(x).nll(targets[r]))
        v = np.concatenate(nlls)
        return PerplexityResult(ppl=float(np.exp(v.mean())), n_tokens=len(v), n_chunks=n, n_ctx=n_ctx, nll=v)

    def save_logits(self, path, text: str | None = None, n_ctx: int = 512, n_chunks: int | None = None, *,
                    tokens=None, progress: bool | None = None, nll_out: list | None = None) -> Path:
        """Write a llama-perplexity base-logits file (--kl-divergence-base format), atomically.
        nll_out, if given, receives each chunk's exact target NLLs (the file keeps log-probs
        only to 16 bits, so a PPL read back from it is approximate)."""
        tokens, n = self._chunks(text, tokens, n_ctx, n_chunks)
        first, last = scored_positions(n_ctx)
        w = LogitsWriter(path, n_ctx, self.n_vocab, tokens, n)
        try:
            for i in progress_bar(range(n), desc="baseline logits", enable=progress):
                chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
                targets = chunk[first + 1:last + 1]
                nll = []
                for r, (x,) in _side_by_side([self], chunk, first, last - first):
                    if nll_out is not None:
                        nll.append(LogDist.of_logits(x).nll(targets[r]))
                    w.add_rows(x)
                w.end_chunk()
                if nll_out is not None:
                    nll_out.append(np.concatenate(nll))
        except BaseException:
            w.abort()
            raise
        w.close()
        return Path(path)

    def kl_divergence(self, text: str | None = None, baseline: "Evaluation | str | os.PathLike | None" = None,
                      n_ctx: int = 512, n_chunks: int | None = None, *, tokens=None,
                      progress: bool | None = None) -> KLDResult:
        """KL divergence of this model's next-token distributions from a baseline's.

        baseline: a Model (evaluated chunk by chunk on the same tokens, exact; it keeps what it evaluated,
        up to PYKVQ_BASELINE_MEMO_MB, for the next model compared with it) or the path of a base-logits file
        written by save_logits() or `llama-perplexity --kl-divergence-base` (tokens come from the file;
        probabilities below e^-16 are dropped as llama-perplexity does).
        """
        if baseline is None:
            raise ValueError("kl_divergence needs a baseline: a Model or a base-logits file")
        if isinstance(baseline, Evaluation):
            return kld_sweep(baseline, {"": self}, text, n_ctx, n_chunks, tokens=tokens, progress=progress,
                             desc=f"KLD {self.cache_type_k}/{self.cache_type_v}")[""]
        acc = KLDAccumulator(n_ctx)
        first, last = scored_positions(n_ctx)
        f = LogitsFile(baseline)
        if f.n_vocab != self.n_vocab:
            raise PykvqError(f"{f.path}: vocabulary {f.n_vocab} differs from the model's {self.n_vocab}")
        if f.n_ctx != n_ctx:
            n_ctx = f.n_ctx
            acc = KLDAccumulator(n_ctx)
            first, last = scored_positions(n_ctx)
        if n_ctx > self.n_ctx:
            raise ContextOverflowError(f"{f.path} was computed with n_ctx={n_ctx} > the model's {self.n_ctx}")
        n = f.n_chunk if n_chunks is None else min(n_chunks, f.n_chunk)
        for i in progress_bar(range(n), desc=f"KLD {self.cache_type_k}/{self.cache_type_v}", enable=progress):
            chunk = f.chunk_tokens(i)
            targets = chunk[first + 1:last + 1]
            for r, (x,) in _side_by_side([self], chunk, first, last - first):
                base, valid = f.chunk_logprobs(i, r)
                acc.add_rows(LogDist.of_logprobs(base), x, targets[r], base_valid=valid)
            acc.n_chunks += 1
        return acc.result()


def kld_sweep(baseline: Evaluation, candidates: dict[str, Evaluation], text: str | None = None, n_ctx: int = 512,
              n_chunks: int | None = None, *, tokens=None, progress: bool | None = None,
              desc: str | None = None) -> dict[str, KLDResult]:
    """KL divergence of several models (cache settings) from one baseline Model
    over the same chunks. The baseline is evaluated once per chunk and shared,
    so N settings cost N + 1 evaluations instead of 2N.

    A chunk whose scored logits outgrow the baseline memo (PYKVQ_BASELINE_MEMO_MB; 4096 tokens of a 150k vocabulary
    are 1.2 GB, 16384 tokens 5 GB) is not held whole: the baseline and every model decode it side by side, a batch
    at a time, and each batch's rows are compared before the next (memory: a batch of rows per model)."""
    for m in candidates.values():
        if m.n_vocab != baseline.n_vocab:
            raise PykvqError(f"vocabularies differ ({baseline.n_vocab} vs {m.n_vocab})")
        m._check_eval_ctx(n_ctx)
    tokens, n = baseline._chunks(text, tokens, n_ctx, n_chunks)
    first, last = scored_positions(n_ctx)
    models = [baseline, *candidates.values()]
    stream = ((last - first) * baseline.n_vocab * 4 > BASELINE_MEMO_BYTES
              and len({id(m) for m in models}) == len(models))      # one context per model: side by side
    accs = {name: KLDAccumulator(n_ctx) for name in candidates}
    for i in progress_bar(range(n), desc=desc or f"KLD sweep ({len(candidates)} settings)", enable=progress):
        chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
        targets = chunk[first + 1:last + 1]
        if stream:
            for r, rows in _side_by_side(models, chunk, first, last - first):
                base = LogDist.of_logits(rows[0])
                p = base.probs()
                for acc, x in zip(accs.values(), rows[1:]):
                    acc.add_rows(base, x, targets[r], base_probs=p)
            for acc in accs.values():
                acc.n_chunks += 1
            continue
        base = baseline._baseline_chunk(chunk)
        p = base.probs()
        for name, m in candidates.items():
            for r, (x,) in _side_by_side([m], chunk, first, last - first):
                accs[name].add_rows(LogDist(base.x[r], base.lse[r]), x, targets[r], base_probs=p[r])
            accs[name].n_chunks += 1
    return {name: a.result() for name, a in accs.items()}


def _side_by_side(models, chunk: np.ndarray, first: int, n_rows: int):
    """(r, [rows of each model]): the chunk's logits for positions first.. (n_rows in all) from every model, decoded
    in step, in blocks of equal rows (models may batch differently), r the block's slice of the scored rows. The rows
    are views of llama.cpp's buffers, valid until the next block is asked for."""
    toks = chunk.tolist()
    its = []
    for m in models:
        t = list(toks)
        if m.add_bos:
            t[0] = m.bos
        its.append(m.iter_logits(t, output_from=first, copy=False))
    cur = [np.empty((0, 0), np.float32)] * len(its)
    off = [0] * len(its)
    r0 = 0
    while r0 < n_rows:
        for j, it in enumerate(its):
            if off[j] == len(cur[j]):
                cur[j], off[j] = next(it), 0
        k = min(n_rows - r0, *(len(c) - o for c, o in zip(cur, off)))
        yield slice(r0, r0 + k), [c[o:o + k] for c, o in zip(cur, off)]
        off = [o + k for o in off]
        r0 += k
    for it in its:
        it.close()
