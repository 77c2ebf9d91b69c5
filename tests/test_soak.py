"""Soak: many sequences started, extended, copied, cut and shifted at random in one context with a quantized
cache (issue 23, item 4).

A seeded schedule drives one context (n_seq_max = 4, unified or one stream per sequence). After every decode,
each sequence that got an output has its last logits checked against an isolated run of its token history
(a fresh context, positions 0..n-1): with the same cache type (tight) and with an f16 cache (within the type's own
error on the same histories). After every operation the cells each sequence holds are counted
(llama_kvq_memory_used_cells) against a hand-kept model of the cache; at the end, every sequence removed, the
cache holds no cell. The fast schedules run in the suite; `make soak` runs long ones over several seeds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from pykvq import Model
from pykvq._lib import ffi
from pykvq.errors import DecodeError
from test_state import kld_rows

N_SEQ = 4
N_CTX = 1024          # non-unified: 256 cells per sequence
MAX_LEN = 200         # a sequence longer than this is cut or shifted before it grows

# setting -> (file, Model keywords)
SETTINGS = {
    "q4_0": ("smollm2", dict(cache_type_k="q4_0", cache_type_v="q4_0")),
    "nuq4": ("smollm2", dict(cache_type_k="nuq4", cache_type_v="nuq4")),
    "bfp4_32": ("smollm2", dict(cache_type_k="bfp4_32", cache_type_v="bfp4_32")),
    "prerope_q4_0": ("prerope", dict(cache_type_k="q4_0", cache_type_v="q4_0")),
}


@dataclass
class Seq:
    toks: list[int]                 # the token history (positions 0..n-1)
    cells: list[int]                # the cell each token sits in (shared ids after seq_cp in a unified cache)
    src: int                        # where the next tokens come from in the text
    shifted: bool = False           # some cell was moved by seq_add (its K requantized, post-RoPE)


@dataclass
class Soak:
    m: Model
    text: list[int]
    rng: np.random.Generator
    unified: bool
    seqs: dict[int, Seq] = field(default_factory=dict)
    checks: list = field(default_factory=list)     # (history, shifted, logits row)
    ops: dict[str, int] = field(default_factory=dict)
    next_cell: int = 0

    def new_cells(self, n):
        self.next_cell += n
        return list(range(self.next_cell - n, self.next_cell))

    def take(self, s: Seq, n: int) -> list[int]:
        if s.src + n > len(self.text):
            s.src = int(self.rng.integers(0, len(self.text) // 2))
        out = self.text[s.src:s.src + n]
        s.src += n
        return out

    # ---- operations ----
    def decode(self, items: dict[int, list[int]]):
        """One batch: items[seq] tokens appended to each sequence; the last of each gets logits."""
        L = self.m._lib
        n = sum(len(t) for t in items.values())
        batch = L.llama_batch_init(n, 0, 1)
        try:
            i, last = 0, {}
            for sid, toks in items.items():
                p0 = len(self.seqs[sid].toks)
                for j, t in enumerate(toks):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, p0 + j, 1
                    batch.seq_id[i][0] = sid
                    batch.logits[i] = j == len(toks) - 1
                    i += 1
                last[sid] = i - 1
            batch.n_tokens = n
            rc = L.llama_decode(self.m._ctx, batch)
            if rc != 0:
                raise DecodeError(f"llama_decode failed ({rc}) with {self.summary()}")
            for sid, toks in items.items():
                s = self.seqs[sid]
                s.toks += toks
                s.cells += self.new_cells(len(toks))
                row = np.frombuffer(ffi.buffer(L.llama_get_logits_ith(self.m._ctx, last[sid]), 4 * self.m.n_vocab),
                                    np.float32).copy()
                self.checks.append((tuple(s.toks), s.shifted, row))
        finally:
            L.llama_batch_free(batch)

    def step(self):
        free = [i for i in range(N_SEQ) if i not in self.seqs]
        live = list(self.seqs)
        ops = []
        if free:
            ops += ["start"] * 2 + (["cp"] * 2 if live else [])
        if live:
            ops += ["extend"] * 4 + ["rm_tail", "rm_seq"] + (["shift"] if self.m._lib.llama_memory_can_shift(self.m._mem) else [])
        op = str(self.rng.choice(ops))
        self.ops[op] = self.ops.get(op, 0) + 1
        if op == "start":
            sid = int(self.rng.choice(free))
            s = self.seqs[sid] = Seq([], [], int(self.rng.integers(0, len(self.text) - 64)))
            extra = {o: self.take(self.seqs[o], int(self.rng.integers(1, 4)))
                     for o in live if self.rng.random() < 0.5 and len(self.seqs[o].toks) < MAX_LEN}
            self.decode({sid: self.take(s, int(self.rng.integers(4, 40))), **extra})   # batched with others
        elif op == "extend":
            pick = [o for o in live if self.rng.random() < 0.7] or live[:1]
            items = {}
            for o in pick:
                s = self.seqs[o]
                if len(s.toks) >= MAX_LEN:
                    self.cut(o, int(self.rng.integers(MAX_LEN // 4, MAX_LEN // 2)))
                items[o] = self.take(s, int(self.rng.integers(1, 4)))
            self.decode(items)
        elif op == "cp":
            src, dst = int(self.rng.choice(live)), int(self.rng.choice(free))
            self.m.seq_cp(src, dst)
            s = self.seqs[src]
            self.seqs[dst] = Seq(list(s.toks), list(s.cells) if self.unified else self.new_cells(len(s.toks)),
                                 int(self.rng.integers(0, len(self.text) - 64)), s.shifted)
        elif op == "rm_seq":
            sid = int(self.rng.choice(live))
            assert self.m.seq_rm(-1, -1, seq=sid)
            del self.seqs[sid]
        elif op == "rm_tail":
            sid = int(self.rng.choice(live))
            n = len(self.seqs[sid].toks)
            if n:          # a sequence cut to nothing earlier stays live with no cells: nothing to cut
                self.cut(sid, int(self.rng.integers(0, n)))
        elif op == "shift":
            sid = int(self.rng.choice(live))
            s = self.seqs[sid]
            shared = self.unified and any(set(s.cells) & set(o.cells) for k, o in self.seqs.items() if k != sid)
            n = len(s.toks)
            if n >= 8 and not shared:
                # drop [a, b) and move the rest down: seq_add moves a cell for every sequence holding it, so a
                # sequence sharing cells with a copy is not shifted (llama.cpp's semantics, not a pykvq choice)
                a = int(self.rng.integers(1, n // 2))
                b = int(self.rng.integers(a + 1, n))
                assert self.m.seq_rm(a, b, seq=sid)
                self.m.seq_add(b, -1, a - b, seq=sid)
                s.toks, s.cells, s.shifted = s.toks[:a] + s.toks[b:], s.cells[:a] + s.cells[b:], True
            else:
                self.ops["shift"] -= 1
                self.ops["shift_skipped"] = self.ops.get("shift_skipped", 0) + 1
        self.check_cells(op)

    def cut(self, sid: int, keep: int):
        assert self.m.seq_rm(keep, -1, seq=sid)
        s = self.seqs[sid]
        s.toks, s.cells = s.toks[:keep], s.cells[:keep]

    def check_cells(self, op):
        for sid in range(N_SEQ):
            want = len(self.seqs[sid].toks) if sid in self.seqs else 0
            got = self.m.used_cells(sid)
            assert got == want, f"after {op}: seq {sid} holds {got} cells, expected {want}; {self.summary()}"
            if sid in self.seqs and want:
                assert self.m.pos_max(sid) == want - 1
        all_cells = set().union(*(s.cells for s in self.seqs.values())) if self.seqs else set()
        assert self.m.used_cells() == len(all_cells), f"after {op}: {self.m.used_cells()} cells used, expected {len(all_cells)}"

    def summary(self) -> str:
        return ", ".join(f"seq {k}: {len(s.toks)} tokens{' shifted' if s.shifted else ''}" for k, s in self.seqs.items())


def references(path, kw, histories) -> dict[tuple, np.ndarray]:
    """Logits after every prefix of the histories, from fresh single-sequence contexts (each maximal history
    evaluated once)."""
    hs = sorted(set(histories), key=len, reverse=True)
    out: dict[tuple, np.ndarray] = {}
    with Model(path, n_ctx=512, flash_attn=True, **kw) as m:
        for h in hs:
            if h in out:
                continue
            rows = m.eval_logits(list(h), output_from=0)
            for i in range(len(h)):
                out.setdefault(h[:i + 1], rows[i])
    return out


def drive(path, kw, unified, n_ops, seed, text) -> Soak:
    """The seeded schedule on one context; every sequence removed at the end leaves no cell used."""
    with Model(path, n_ctx=N_CTX, flash_attn=True, n_seq_max=N_SEQ, kv_unified=unified, **kw) as m:
        soak = Soak(m, text, np.random.default_rng(seed), unified)
        for _ in range(n_ops):
            soak.step()
        for sid in list(soak.seqs):
            assert m.seq_rm(-1, -1, seq=sid)
            del soak.seqs[sid]
        soak.check_cells("removing every sequence")
        assert m.used_cells() == 0
    return soak


def run_soak(setting, unified, n_ops, seed, files, text):
    name, kw = SETTINGS[setting]
    path = files[name]
    t0 = time.time()
    soak = drive(path, kw, unified, n_ops, seed, text)
    t_soak = time.time() - t0
    # The same schedule (it never depends on the logits) on an f16 cache: the reference for shifted sequences.
    # A fresh run of a shifted sequence's spliced history is not one: the cells after the removed range hold K/V
    # computed while the removed tokens were there, in any cache type.
    mirror = drive(path, dict(cache_type_k="f16", cache_type_v="f16"), unified, n_ops, seed, text)
    assert [c[0] for c in mirror.checks] == [c[0] for c in soak.checks]
    hist = [c[0] for c in soak.checks]
    same = references(path, kw, hist)
    f16 = references(files["smollm2"], dict(cache_type_k="f16", cache_type_v="f16"), hist)
    stats = {"plain": [], "shifted": []}
    for (h, shifted, row), (_, _, mrow) in zip(soak.checks, mirror.checks):
        stats["shifted" if shifted else "plain"].append(
            (kld_rows(row, same[h]), kld_rows(same[h], f16[h]), kld_rows(row, f16[h]),
             int(row.argmax() == same[h].argmax()), np.sort(same[h])[-1] - np.sort(same[h])[-2], kld_rows(row, mrow)))
    print(f"\n{setting} unified={unified} seed={seed}: {n_ops} ops {soak.ops}, {len(soak.checks)} checks, "
          f"soak {t_soak:.1f}s, total {time.time() - t0:.1f}s")
    for k, rows in stats.items():
        if rows:
            a = np.array(rows)
            print(f"  {k:8s} n={len(a)}: KLD vs same type mean {a[:, 0].mean():.2e} max {a[:, 0].max():.2e}; "
                  f"same type vs f16 mean {a[:, 1].mean():.4f}; soak vs f16 mean {a[:, 2].mean():.4f} "
                  f"max {a[:, 2].max():.4f}; top-1 same {a[:, 3].mean():.3f}; vs the f16 mirror mean {a[:, 5].mean():.4f} "
                  f"max {a[:, 5].max():.4f}")
    return soak, stats


@pytest.fixture(scope="module")
def files(smollm2, smollm2_prerope):
    return {"smollm2": smollm2, "prerope": smollm2_prerope}


@pytest.fixture(scope="module")
def text(smollm2, wikitext):
    with Model(smollm2, n_ctx=256) as m:
        return m.tokenize(wikitext[:60000], add_special=False)


def assert_within(stats, setting):
    plain = np.array(stats["plain"])
    # Unshifted: the same tokens as an isolated run, their K/V computed in other batch shapes. Float rounding then
    # flips some 4-bit quantization steps, so the soak is another quantization of the same history: its distance
    # from the isolated run is bounded by the type's own error vs f16 on the same histories, not by float noise
    # (a single sequence re-decoded in the same shapes: < 1e-4, test_state). 24 long soaks (400 ops, seeds 1-3,
    # 4 settings x unified/split, 217-420 checks each) measured the mean at 0.18-0.65x the type's own mean,
    # the 95th percentile at 0.03-0.18 against own 99th percentiles of 0.18-1.22, top-1 the same in 86-95%;
    # single checks reach the type's own worst (nuq4: 2.5 vs 2.6), so no bound is put on the maximum. Reading
    # another sequence's cells or a stale cell gives KLD ~1-10 on most checks: far outside these bounds.
    assert plain[:, 0].mean() < plain[:, 1].mean(), (plain[:, 0].mean(), plain[:, 1].mean())
    assert np.percentile(plain[:, 0], 95) < np.percentile(plain[:, 1], 99), \
        (np.percentile(plain[:, 0], 95), np.percentile(plain[:, 1], 99))
    assert plain[:, 3].mean() > 0.8
    # against f16: as far as the type itself is on the same histories
    assert plain[:, 2].mean() < 1.2 * plain[:, 1].mean() + 0.002, (plain[:, 2].mean(), plain[:, 1].mean())
    if stats["shifted"]:
        shifted = np.array(stats["shifted"])
        # against the f16 cache that went through the same operations: within twice the type's own error on
        # unshifted histories. A post-RoPE quantized key is dequantized, rotated and requantized at every shift
        # (upstream's K-shift), so a cell shifted many times drifts: the long schedules measured (seed 1, 400 ops)
        # nuq4 with one stream per sequence (48 shifts) at 0.237 against a bound of 0.125, while q4_0 (0.075 /
        # 0.135), nuq4 unified (0.105 / 0.117) and bfp4_32 (0.171 / 0.298) stayed within. That drift is what the
        # pre-RoPE cache removes (a shift only moves positions), so there the bound is strict.
        bound = 2 * plain[:, 1].mean() + 0.005
        ok = shifted[:, 5].mean() < bound
        if not ok and not setting.startswith("prerope"):
            # the drift is expected, but not without limit: the worst measured was 1.9x the bound, while a stale or
            # foreign cell gives KLD ~1-10 on most checks, far above 4x
            assert shifted[:, 5].mean() < 4 * bound, ("beyond K-shift drift", shifted[:, 5].mean(), bound)
            pytest.xfail(f"post-RoPE K-shift requantization drift: {shifted[:, 5].mean():.3f} vs the f16 mirror, "
                         f"bound {bound:.3f} (hard limit {4 * bound:.3f})")
        assert ok, (shifted[:, 5].mean(), plain[:, 1].mean())


@pytest.mark.parametrize("setting,unified", [("q4_0", False),
                                             pytest.param("nuq4", True, marks=pytest.mark.soak),
                                             pytest.param("bfp4_32", False, marks=pytest.mark.soak),
                                             pytest.param("prerope_q4_0", True, marks=pytest.mark.soak)])
def test_soak_fast(setting, unified, files, text):
    """30 operations on 4 sequences; in the suite: q4_0 with one stream per sequence."""
    _, stats = run_soak(setting, unified, 30, 0, files, text)
    assert_within(stats, setting)


@pytest.mark.soak
@pytest.mark.parametrize("unified", [False, True])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_soak_long(setting, unified, seed, files, text):
    _, stats = run_soak(setting, unified, 400, seed, files, text)
    assert_within(stats, setting)
