"""Evaluate several cache settings against one baseline in a single pass.

The baseline's logits are computed once per chunk and shared, so comparing N
settings costs N + 1 evaluations instead of 2N.
"""
from __future__ import annotations

import numpy as np

from .eval import KLDAccumulator, KLDResult, log_softmax, scored_positions
from .model import Model
from .progress import progress_bar


def kld_sweep(baseline: Model, candidates: dict[str, Model], text: str, n_ctx: int = 512,
              n_chunks: int | None = None, progress: bool | None = None) -> tuple[float, dict[str, KLDResult]]:
    """(baseline PPL, {name: KLDResult}) over the same chunks of text."""
    tokens, n = baseline._chunks(text, None, n_ctx, n_chunks)
    first, last = scored_positions(n_ctx)
    accs = {name: KLDAccumulator(n_ctx) for name in candidates}
    base_nll = []
    for i in progress_bar(range(n), desc=f"KLD sweep ({len(candidates)} settings)", enable=progress):
        chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
        targets = chunk[first + 1:last + 1]
        base = log_softmax(baseline._chunk_logits(chunk))
        base_nll.append(-base[np.arange(len(targets)), targets])
        for name, m in candidates.items():
            accs[name].add(base, m._chunk_logits(chunk), targets)
    ppl = float(np.exp(np.concatenate(base_nll).mean()))
    return ppl, {name: a.result() for name, a in accs.items()}
