"""Settings of the quality matrix: (K type, V type, converter transform, online rotation).

On the command line a setting is written  K[/V][@TRANSFORM][:rot-on|:rot-off][:centred][:stock-scales|:lsq-scales]

    q4_0              K and V q4_0, unconverted model, rotation at upstream's auto
    q8_0/q4_0         q8_0 keys, q4_0 values
    nuq3o@fisher      converted with Fisher codebooks fitted for nuq3o
    nuq4@smooth+vrot  pair smoothing + V Hadamard baked in, Fisher codebooks for nuq4
    f16/q4_0@vlearned a learned invertible V transform for q4_0 values (vhad: the Hadamard alone)
    q4_0/f16@smooth+klearned  learned per-pair Q/K complex scales, started from pair smoothing
    auto@kvbits-3.6   per-layer types chosen by the converter for 3.6 bits/value
    q4_0@prerope      pre-RoPE, centred key cache (--prerope-k; nuq types get codebooks fitted in that domain)
    q4_0@prerope-mean the same with the mean only (no per-channel scale): an ablation
    q4_0@prerope-std  the same with the per-channel std as the scale (the default is Fisher-weighted): an ablation
    q4_0@prerope-backprop  the same, calibrated by transformers' backward pass (the diagonal Fisher) instead of the
                      runtime's forward pass (the converter's default for a GGUF)
    auto@prerope+kvbits-4.5  per-layer types for 4.5 bits/value, fitted in the pre-RoPE key domain
    q4_0:rot-off      upstream's online Hadamard rotation switched off (of the centred keys with @prerope)
    q4_0@prerope:centred  the same file, keys cached after RoPE minus the mean rotated with them (PYKVQ_K_DOMAIN=centred)
    q4_0@prerope:stock-scales  the same file with ggml's q4_0 / q5_0 encoder (a converted file's default is
                      least-squares block scales: PYKVQ_ENCODER); q4_0:lsq-scales  a stock file with them
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..cache_types import CACHE_TYPES, KVQ_TYPES, UNQUANTIZED
from ..errors import PykvqError

NUQ = tuple(n for n, t in KVQ_TYPES.items() if t.family == "nuq")
# transform -> converter flags (before the target cache types)
TRANSFORMS = {
    "none": None,
    "fisher": [],
    "smooth+vrot": ["--smooth-qk", "--rotate-v", "hadamard"],
    "ksort+smooth": ["--ksort", "--smooth-qk"],
    "vhad": ["--rotate-v", "hadamard"],                    # V/O Hadamard only
    "vlearned": ["--rotate-v", "learned"],                 # V/O learned invertible transform (issue 8)
    "vlearned-fisher": ["--rotate-v", "learned", "--learn-loss", "fisher"],
    "smooth": ["--smooth-qk"],
    "smooth+klearned": ["--smooth-qk", "--learn-k"],       # learned pair scale + angle, from smoothing's
    "prerope": ["--prerope-k"],                            # pre-RoPE centred key cache (issue 20)
    "prerope-mean": ["--prerope-k", "--prerope-k-scale", "one"],
    "prerope-std": ["--prerope-k", "--prerope-k-scale", "std"],   # the scale before the Fisher-weighted default
    # calibration by transformers' backward pass (the Fisher) instead of the runtime's forward pass (issue 36)
    "prerope-backprop": ["--prerope-k", "--sensitivity", "backprop"],
}
_KVBITS = re.compile(r"^(prerope\+)?kvbits-(\d+(?:\.\d+)?)$")


@dataclass(frozen=True)
class Setting:
    k: str                       # cache type, or "auto" = the converted file's (per-layer) types
    v: str
    transform: str = "none"
    rotation: str = "auto"       # upstream's online Hadamard rotation: auto | on | off
    k_domain: str = "auto"       # auto | centred (a @prerope file's keys post-RoPE minus the rotated mean)
    encoder: str = "auto"        # auto | stock | lsq: q4_0 / q5_0 block scales (auto: lsq for a converted file)
    sinks: int = 0               # a pre-RoPE cache's first positions kept unquantized (exact window, :sinks-S)
    window: int = 0              # and the last positions up to each query (:win-W)

    @property
    def label(self) -> str:
        s = self.k if self.k == self.v else f"{self.k}/{self.v}"
        if self.transform != "none":
            s += f"@{self.transform}"
        if self.rotation != "auto":
            s += f":rot-{self.rotation}"
        if self.k_domain != "auto":
            s += f":{self.k_domain}"
        if self.encoder != "auto":
            s += f":{self.encoder}-scales"
        if self.sinks:
            s += f":sinks-{self.sinks}"
        if self.window:
            s += f":win-{self.window}"
        return s

    @property
    def stock(self) -> bool:
        """Only upstream llama.cpp types and no conversion (what a stock build can run)."""
        return (self.transform == "none" and self.encoder != "lsq"
                and not any(t in KVQ_TYPES or t == "auto" for t in (self.k, self.v)))

    def variant(self) -> str | None:
        """Name of the converted file (None: the model as fetched). Stable, so files are reused."""
        if self.transform == "none":
            return None
        m = _KVBITS.match(self.transform)
        if m:
            return f"{'prerope-' if m.group(1) else ''}mixed-{m.group(2)}"
        types = self.k if self.k == self.v else f"{self.k}-{self.v}"
        if self.transform == "fisher":
            return f"cb-fisher-{types}"
        return f"{self.transform}+cb-{types}"

    def converter_flags(self) -> list[str]:
        m = _KVBITS.match(self.transform)
        if m:
            return (["--prerope-k"] if m.group(1) else []) + ["--kv-bits", m.group(2)]
        return TRANSFORMS[self.transform] + ["--cache-type-k", self.k, "--cache-type-v", self.v]

    def model_kwargs(self, evaluation: bool = False) -> dict:
        """Model(...) keyword arguments: cache types (None = the file's), rotation, domain, encoder, window; for a
        quality evaluation (evaluation=True) also the ubatch a window is judged in."""
        kw = dict(cache_type_k=None if self.k == "auto" else self.k,
                  cache_type_v=None if self.v == "auto" else self.v,
                  attn_rot_k=self.rotation, attn_rot_v=self.rotation)
        if self.k_domain != "auto":
            kw["k_domain"] = self.k_domain
        if self.encoder != "auto":
            kw["encoder"] = self.encoder
        # always named: a --prerope-k file's own default window (pykvq.cache.kv_window) would otherwise apply to
        # a setting whose label names none
        kw.update(kv_sinks=self.sinks, kv_window=self.window)
        return kw

    def window_bits(self, n_ctx: int, row_type: str = "f16") -> float:
        """Bits per value the exact window adds at n_ctx cells in rows of row_type (pykvq.cache_info.window_bits)."""
        from ..cache_info import window_bits
        return window_bits(self.sinks, self.window, n_ctx, row_type)


def parse_setting(spec: str) -> Setting:
    """Parse K[/V][@TRANSFORM][:rot-on|:rot-off][:centred][:stock-scales|:lsq-scales] (see the module doc)."""
    s, rotation, k_domain, encoder = spec.strip(), "auto", "auto", "auto"
    exact = {"sinks": 0, "win": 0}
    for key in ("win", "sinks"):
        m = re.search(rf":{key}-(\d+)$", s)
        if m:
            exact[key], s = int(m.group(1)), s[:m.start()]
    m = re.search(r":(stock|lsq)-scales$", s)
    if m:
        encoder, s = m.group(1), s[:m.start()]
    if s.endswith(":centred"):
        k_domain, s = "centred", s[:-len(":centred")]
    m = re.search(r":rot-(on|off|auto)$", s)
    if m:
        rotation, s = m.group(1), s[:m.start()]
    s, _, transform = s.partition("@")
    transform = transform or "none"
    k, _, v = s.lower().partition("/")      # type names as cache_types.resolve takes them
    v = v or k
    if transform not in TRANSFORMS and not _KVBITS.match(transform):
        raise PykvqError(f"setting {spec!r}: unknown transform {transform!r} "
                         f"(one of {', '.join(TRANSFORMS)}, kvbits-B)")
    for t in (k, v):
        if t == "auto":
            if not _KVBITS.match(transform):
                raise PykvqError(f"setting {spec!r}: 'auto' types need a per-layer conversion (@kvbits-B)")
        elif t not in CACHE_TYPES:
            raise PykvqError(f"setting {spec!r}: unknown cache type {t!r} (one of {', '.join(CACHE_TYPES)})")
    if transform == "fisher" and not any(t in NUQ for t in (k, v)):
        raise PykvqError(f"setting {spec!r}: Fisher codebooks need a nuq type for K or V")
    if k in UNQUANTIZED and v in UNQUANTIZED and transform == "none" and rotation != "auto":
        raise PykvqError(f"setting {spec!r}: rotation applies to quantized caches only")
    if k_domain == "centred" and not transform.startswith("prerope"):
        raise PykvqError(f"setting {spec!r}: ':centred' needs a file with pre-RoPE statistics (@prerope...)")
    if encoder != "auto" and not {k, v} & {"q4_0", "q5_0", "auto"}:
        raise PykvqError(f"setting {spec!r}: ':{encoder}-scales' applies to q4_0 / q5_0 caches only")
    if (exact["sinks"] or exact["win"]) and (not transform.startswith("prerope") or k_domain == "centred"):
        raise PykvqError(f"setting {spec!r}: ':sinks-S' / ':win-W' keep pre-RoPE keys exact: a @prerope file's")
    return Setting(k, v, transform, rotation, k_domain, encoder, exact["sinks"], exact["win"])


def parse_settings(specs: str | list[str]) -> list[Setting]:
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    out = list(dict.fromkeys(parse_setting(s) for s in specs))
    if not out:
        raise PykvqError("no settings given")
    return out


# The default matrices. "full": every format, the stock peers with and without rotation, the
# converter's transforms and per-layer budgets. "core": the rows that matter, for a slow model.
# "quick": CI-sized.
MATRICES = {
    "full": ["q8_0", "q5_0", "q4_0", "q4_0:rot-off", "iq4_nl", "q8_0/q4_0",
             "bfp8_32", "bfp4_32", "bfp4_64", "nuq4", "nuq3", "nuq3o", "nuq2", "nuq2o",
             "nuq4@fisher", "nuq3@fisher", "nuq3o@fisher", "nuq2o@fisher",
             "nuq4@smooth+vrot", "nuq3o@smooth+vrot", "nuq2o@smooth+vrot", "q4_0@smooth+vrot",
             "q8_0/nuq3o", "auto@kvbits-2.75", "auto@kvbits-3.6", "auto@kvbits-4.5",
             "q4_0@prerope", "q4_0@prerope:centred", "q4_0@prerope-mean", "q4_0@prerope:rot-off", "nuq4@prerope",
             "q4_0/f16@prerope", "q4_0@prerope-std", "q4_0@prerope:stock-scales", "q53_64/q4_0@prerope",
             "q53_64/f16@prerope", "q8_0/q4_0@prerope",
             "auto@prerope+kvbits-4.5", "auto@prerope+kvbits-3.6", "auto@prerope+kvbits-2.75"],
    "core": ["q8_0", "q4_0", "q4_0:rot-off", "q8_0/q4_0", "bfp4_32", "nuq4", "nuq3o", "nuq2o",
             "nuq4@fisher", "nuq3o@fisher", "nuq2o@fisher", "nuq3o@smooth+vrot", "q8_0/nuq3o",
             "q4_0@prerope", "q4_0@prerope:centred", "nuq4@prerope", "q53_64/q4_0@prerope", "q8_0/q4_0@prerope",
             "auto@prerope+kvbits-4.5", "auto@prerope+kvbits-3.6", "auto@prerope+kvbits-2.75"],
    "quick": ["q8_0", "q4_0", "nuq4"],
}


def matrix(name_or_specs: str) -> list[Setting]:
    return parse_settings(MATRICES.get(name_or_specs, name_or_specs))
