"""Read and write llama-perplexity's base-logits file (--kl-divergence-base).

Layout (little endian): b"_logits_", u32 n_ctx, i32 n_vocab, i32 n_chunk,
i32 tokens[n_chunk * n_ctx], then for each chunk (n_ctx - 1 - n_ctx//2) rows of
nv = 2*((n_vocab+1)//2) + 4 uint16: two float32 (scale, min_log_prob) followed
by log-probabilities quantized to 16 bits over [max - 16, max].

Writing this format lets pykvq and llama-perplexity share a baseline, so the
two KLD implementations can be checked against each other on the same data.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from .errors import PykvqError

MAGIC = b"_logits_"


def row_width(n_vocab: int) -> int:
    return 2 * ((n_vocab + 1) // 2) + 4


def encode_rows(logits: np.ndarray) -> np.ndarray:
    """Quantize logit rows the way llama-perplexity does (float32 arithmetic)."""
    x = np.asarray(logits, dtype=np.float32)
    n, n_vocab = x.shape
    mx = x.max(axis=1)
    mn = np.maximum(x.min(axis=1), mx - np.float32(16))
    sum_exp = np.exp((x - mx[:, None]).astype(np.float32)).astype(np.float64).sum(axis=1)
    log_sum_exp = np.log(sum_exp).astype(np.float32)
    min_log_prob = (mn - mx - log_sum_exp).astype(np.float32)
    scale = ((mx - mn) / np.float32(65535)).astype(np.float32)
    out = np.zeros((n, row_width(n_vocab)), dtype=np.uint16)
    out[:, 0:2] = scale[:, None].view(np.uint16)
    out[:, 2:4] = min_log_prob[:, None].view(np.uint16)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        q = np.rint(inv[:, None] * (x - mn[:, None])).astype(np.float32)
    q = np.where(x > mn[:, None], q, 0)
    out[:, 4:4 + n_vocab] = np.clip(q, 0, 65535).astype(np.uint16)
    return out


def decode_rows(rows: np.ndarray, n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(log-probabilities float32, as llama-perplexity computes them; mask of entries it counts: > -16)."""
    rows = np.ascontiguousarray(rows)
    head = rows[:, :4].copy().view(np.float32)
    scale, min_log_prob = head[:, 0:1], head[:, 1:2]
    lp = scale * rows[:, 4:4 + n_vocab].astype(np.float32) + min_log_prob
    return lp, lp > -16.0


class LogitsFile:
    """A base-logits file opened for reading (memory-mapped)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise PykvqError(f"baseline logits file not found: {self.path}")
        with open(self.path, "rb") as f:
            if f.read(8) != MAGIC:
                raise PykvqError(f"{self.path} is not a llama-perplexity logits file (bad magic)")
            hdr = np.frombuffer(f.read(12), dtype="<i4")
        if len(hdr) != 3:
            raise PykvqError(f"{self.path}: truncated header")
        self.n_ctx, self.n_vocab, self.n_chunk = (int(v) for v in hdr)
        self.nv = row_width(self.n_vocab)
        self.rows_per_chunk = self.n_ctx - 1 - self.n_ctx // 2
        tok_off = 20
        self._data_off = tok_off + 4 * self.n_ctx * self.n_chunk
        need = self._data_off + 2 * self.nv * self.rows_per_chunk * self.n_chunk
        size = self.path.stat().st_size
        if size < need:
            raise PykvqError(f"{self.path}: truncated ({size} bytes, header promises {need})")
        self.tokens = np.fromfile(self.path, dtype="<i4", count=self.n_ctx * self.n_chunk, offset=tok_off)
        self._rows = np.memmap(self.path, dtype="<u2", mode="r", offset=self._data_off,
                               shape=(self.n_chunk, self.rows_per_chunk, self.nv))

    def chunk_tokens(self, i: int) -> np.ndarray:
        return self.tokens[i * self.n_ctx:(i + 1) * self.n_ctx]

    def chunk_logprobs(self, i: int, rows: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """Chunk i's scored rows (some of them: a long chunk is read a batch at a time)."""
        return decode_rows(self._rows[i, rows], self.n_vocab)


class LogitsWriter:
    """Writes a base-logits file atomically: chunks are appended to a temp file
    that replaces the target only on close()."""

    def __init__(self, path: str | os.PathLike, n_ctx: int, n_vocab: int, tokens: np.ndarray, n_chunk: int):
        self.path = Path(path)
        self.n_ctx, self.n_vocab, self.n_chunk = n_ctx, n_vocab, n_chunk
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".", suffix=".tmp")
        self._f = os.fdopen(fd, "wb")
        self._f.write(MAGIC)
        self._f.write(np.array([n_ctx, n_vocab, n_chunk], dtype="<i4").tobytes())
        self._f.write(np.asarray(tokens[:n_ctx * n_chunk], dtype="<i4").tobytes())
        self._written = 0
        self._rows_now = 0
        self.rows_per_chunk = n_ctx - 1 - n_ctx // 2

    def add_chunk(self, logits: np.ndarray) -> None:
        self.add_rows(logits)
        self.end_chunk()

    def add_rows(self, logits: np.ndarray) -> None:
        """The next scored rows of the chunk being written (a long chunk goes a batch at a time)."""
        self._f.write(encode_rows(logits).astype("<u2").tobytes())
        self._rows_now += len(logits)

    def end_chunk(self) -> None:
        if self._rows_now != self.rows_per_chunk:
            raise PykvqError(f"a chunk of {self.n_ctx} has {self.rows_per_chunk} scored rows, got {self._rows_now}")
        self._rows_now = 0
        self._written += 1

    def close(self) -> None:
        self._f.close()
        if self._written != self.n_chunk:
            os.unlink(self._tmp)
            raise PykvqError(f"logits file incomplete: {self._written}/{self.n_chunk} chunks")
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._f.close()
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)
