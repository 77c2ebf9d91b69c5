"""Passkey retrieval at increasing distance (the test of KVQuant's Table 3, after Mohtashami & Jaggi).

A 5-digit key is hidden near the start of a long stretch of repetitive
filler; at each length L the question is appended and the model answers
greedily. Success = the first number it writes is the key. One trial costs
one fill to the largest length: after answering at L the question and answer
are removed from the cache (seq_rm) and the filler goes on to the next L, so
every length is asked about the same cache. The key sits at a random position
in the first half of the shortest length, so at length L it is about L tokens
back. Raw text, no chat template: the test is about the cache, not about
instruction following.
"""
from __future__ import annotations

import random
import re
import sys
import time
from pathlib import Path

import numpy as np

from ..model import Model
from .store import ResultStore

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it at the end.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8


def _say(msg: str) -> None:
    print(f"[pykvq passkey] {msg}", file=sys.stderr, flush=True)


def answer(m: Model, tokens: list[int], pos: int) -> str:
    """Greedy continuation of tokens appended at pos (the cache holds [0, pos) already)."""
    logits = m.decode(tokens, pos)
    pos += len(tokens)
    out = []
    for _ in range(ANSWER_TOKENS):
        tok = int(np.argmax(logits))
        if m._lib.llama_vocab_is_eog(m._vocab, tok):
            break
        out.append(tok)
        logits = m.decode([tok], pos)
        pos += 1
    return m.detokenize(out)


def trial(m: Model, key: int, needle_at: int, lengths: list[int]) -> dict[int, str]:
    """Answers at each length for one key placed after about needle_at tokens."""
    intro = m.tokenize(INTRO, add_special=True)
    unit = m.tokenize(FILLER, add_special=False)
    needle = m.tokenize(NEEDLE.format(key=key), add_special=False)
    question = m.tokenize(QUESTION, add_special=False)
    n_before = max(0, (needle_at - len(intro)) // len(unit))
    n_after = (max(lengths) - len(question)) // len(unit) + 1
    stream = intro + unit * n_before + needle + unit * n_after
    m.reset()
    answers, pos = {}, 0
    for L in sorted(lengths):
        end = L - len(question)
        while pos < end:
            n = min(m.n_batch, end - pos)
            m._decode(stream[pos:pos + n], pos)
            pos += n
        answers[L] = answer(m, question, pos)
        m.seq_rm(pos, -1)
    return answers


def found(text: str, key: int) -> bool:
    nums = re.findall(r"\d+", text)
    return bool(nums) and nums[0] == str(key)


def run(src: Path, settings: list, out: Path, *, lengths: list[int], trials: int = 3,
        seed: int = 1234) -> ResultStore:
    """Success per length for each suite Setting (cache types; a converted file where it has a transform)."""
    from .converted import for_setting
    lengths = sorted(set(lengths))
    config = {"model": src.name, "model_bytes": src.stat().st_size, "lengths": lengths, "trials": trials,
              "seed": seed, "needle": "uniform in the first half of the shortest length"}
    store = ResultStore(out, config)
    rng = random.Random(seed)
    plan = [(rng.randrange(10000, 100000), rng.randrange(0, max(1, lengths[0] // 2))) for _ in range(trials)]
    n_ctx = max(lengths) + ANSWER_TOKENS + 8
    for s in settings:
        label = s.label
        if label in store:
            continue
        path, _ = for_setting(src, s)
        t0 = time.time()
        with Model(path, n_ctx=n_ctx, flash_attn=True, **s.model_kwargs()) as m:
            if m.n_ctx < n_ctx:
                raise ValueError(f"context {m.n_ctx} < {n_ctx}")
            runs = []
            for i, (key, at) in enumerate(plan):
                ans = trial(m, key, at, lengths)
                runs.append({"key": key, "needle_at": at, "answers": {str(L): a for L, a in ans.items()}})
                _say(f"{label} trial {i + 1}/{trials}: " + ", ".join(
                    f"{L}:{'ok' if found(a, key) else 'miss'}" for L, a in ans.items()))
        success = {str(L): sum(found(r["answers"][str(L)], r["key"]) for r in runs) / trials for L in lengths}
        store.put(label, {"label": label, "k": s.k, "v": s.v, "transform": s.transform, "success": success, "runs": runs,
                          "seconds": round(time.time() - t0, 1)})
    return store
