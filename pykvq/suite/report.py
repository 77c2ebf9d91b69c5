"""docs/RESULTS.md and the PNG plots, from the JSON files the suite wrote.

Everything here reads results/<kind>_<model>.json; nothing is measured. Ratios
are always to rows of the same file (same run, same machine).
"""
from __future__ import annotations

import datetime
from pathlib import Path

from ..cache_types import KVQ_TYPES
from .speed import UPSTREAM_F16
from .settings import Setting, parse_setting
from .store import load

HEADLINE = ["q8_0", "q4_0", "q8_0/q4_0", "bfp4_32", "nuq4", "nuq4@fisher", "nuq3o@fisher", "q8_0/nuq3o",
            "auto@kvbits-3.6", "nuq2o@fisher",
            "q4_0@prerope", "nuq4@prerope", "q53_64/q4_0@prerope", "auto@prerope+kvbits-3.6", "auto@prerope+kvbits-2.75"]


def bench_label(label: str, bench_rows: dict) -> str | None:
    """The speed row that measures a quality row's cache: the same setting, or for a transform that
    leaves the cache's read path alone (codebooks, smoothing, V rotation) the plain type. A pre-RoPE
    file decodes differently and per-layer files have their own mix: those need their own row."""
    if label in bench_rows:
        return label
    s = parse_setting(label)
    same_read_path = (s.k != "auto" and not s.transform.startswith("prerope")
                      and (s.rotation, s.k_domain, s.encoder) == ("auto", "auto", "auto"))
    plain = Setting(s.k, s.v).label
    return plain if same_read_path and plain in bench_rows else None


def pareto_front(rows: list[dict]) -> list[dict]:
    """Rows no other row beats on both bits/value and mean KLD (lower is better), by bits."""
    front = []
    for r in sorted(rows, key=lambda r: (r["bits_per_value"], r["mean_kld"])):
        if not front or r["mean_kld"] < front[-1]["mean_kld"]:
            front.append(r)
    return front


def kind_of(r: dict) -> str:
    if r.get("stock", False) or r["label"] == "f16":
        return "stock llama.cpp"
    if "kvbits" in r["transform"]:
        return "pykvq per-layer types"
    if r["transform"] != "none":
        return "pykvq + converter transforms"
    return "pykvq cache types"


STYLE = {"stock llama.cpp": ("tab:blue", "o"), "pykvq cache types": ("tab:red", "s"),
         "pykvq + converter transforms": ("tab:green", "^"), "pykvq per-layer types": ("tab:purple", "D")}


def label_positions(rows: list[dict], dx: float = 0.3, step: float = 1.22) -> list[tuple[dict, float]]:
    """Label heights for a log-y scatter: points within dx bits of each other form a column, and
    their labels are spread by a factor `step` around the column's geometric mean, in KLD order."""
    import math
    out, group = [], []
    for r in sorted(rows, key=lambda r: r["bits_per_value"]) + [None]:
        if group and (r is None or r["bits_per_value"] - group[0]["bits_per_value"] > dx):
            group.sort(key=lambda g: -g["mean_kld"])
            mid = math.exp(sum(math.log(g["mean_kld"]) for g in group) / len(group))
            for i, g in enumerate(group):
                out.append((g, mid * step ** ((len(group) - 1) / 2 - i)))
            group = []
        if r is not None:
            group.append(r)
    return out


def plot_pareto(rows: list[dict], meta: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if r["label"] != "f16"]
    front = pareto_front(rows)
    fig, ax = plt.subplots(figsize=(11, 6.4))
    for kind, (color, marker) in STYLE.items():
        pts = [r for r in rows if kind_of(r) == kind]
        if pts:
            ax.scatter([r["bits_per_value"] for r in pts], [r["mean_kld"] for r in pts], s=42, color=color,
                       marker=marker, label=kind, zorder=3, edgecolors="black", linewidths=0.4)
    ax.plot([r["bits_per_value"] for r in front], [r["mean_kld"] for r in front], color="black", lw=1,
            ls="--", zorder=2, label="Pareto front")
    for r, y in label_positions(rows):
        ax.annotate(r["label"], (r["bits_per_value"], r["mean_kld"]), xytext=(r["bits_per_value"] + 0.12, y),
                    fontsize=7, color=STYLE[kind_of(r)][0], va="center",
                    arrowprops=dict(arrowstyle="-", color="0.6", lw=0.5))
    ax.set_yscale("log")
    ax.set_xlabel("KV-cache bits per value (K and V, all layers; f16 = 16)")
    ax.set_ylabel("mean KL divergence vs f16 cache (nats, log scale)")
    ax.set_title(f"{meta['model']}: quality vs cache size ({meta['text']}, ctx {meta['n_ctx']}, "
                 f"{rows[0]['n_tokens']} scored tokens)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speed(rows: list[dict], meta: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    depths = meta["depths"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, test, n in ((axes[0], "tg", meta["tg"]), (axes[1], "pp", meta["pp"])):
        for r in rows:
            ys = [r["tokens_per_s"].get(f"{test}{n} @ d{d}") for d in depths]
            ours = r["label"].startswith(tuple(KVQ_TYPES))
            up = r["label"] == UPSTREAM_F16
            ax.plot(depths, ys, marker="o", ls=":" if up else "-" if ours else "--", label=r["label"],
                    lw=2.2 if r["label"] == "f16" else 1.4,
                    color="black" if r["label"] == "f16" else "gray" if up else None)
        ax.set_xlabel("KV depth (tokens already in the cache)")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{'decode, 1 token' if test == 'tg' else f'prefill, {n}-token batch'} at depth", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    dev = f"GPU ({meta['n_gpu_layers']} layers offloaded)" if meta.get("n_gpu_layers") else \
        f"CPU, {meta['threads']} threads"
    fig.suptitle(f"{meta['model']}, {dev}; dashed = stock llama.cpp types, solid = pykvq", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _f(x: float, nd: int = 4) -> str:
    return f"{x:.{nd}f}"


def quality_md(d: dict, model: str, img: str | None) -> list[str]:
    meta, rows = d["meta"]["config"], list(d["rows"].values())
    rows.sort(key=lambda r: (-r["bits_per_value"], r["mean_kld"]))
    front = {r["label"] for r in pareto_front([r for r in rows if r["label"] != "f16"])}
    n_tok = rows[0]["n_tokens"]
    md = [f"### Quality: {meta['model']}", "",
          f"{meta['text']}, {meta['chunks']} chunks of {meta['n_ctx']} tokens ({n_tok} scored), flash "
          "attention on; every row against the unconverted model with an f16 cache. `K/V` = different "
          "types; `@fisher` = converted with Fisher codebooks for that type; `@smooth+vrot` = pair smoothing "
          "and V Hadamard baked in (plus codebooks); `@kvbits-B` = per-layer types for a B-bit budget; "
          "`@prerope` = pre-RoPE centred key cache (`--prerope-k`, per-channel scale weighted by the runtime's "
          "forward estimate of each channel's Fisher; `prerope-backprop`: by the backward pass's Fisher; "
          "`prerope-mean`: mean only, no scale; `prerope-std`: the std as the scale), a converted file's q4_0 / "
          "q5_0 written with least-squares block scales (`:stock-scales`: ggml's encoder); `:centred` = the same "
          "file, keys after RoPE minus the rotated mean; `q53_64` = 5 / 3-bit key halves (pre-RoPE files only); "
          "`:rot-off` = upstream's online Hadamard rotation off (default: upstream's auto). **bold** = on "
          "the Pareto front (no row has both fewer bits and lower KLD). ± = standard error of the mean KLD.",
          "", "| setting | bits/value | KV size vs f16 | mean KLD | p99 KLD | same top-1 | PPL | rotation/baked |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = f"**{r['label']}**" if r["label"] in front else r["label"]
        act = r.get("active", "").replace("online Hadamard rotation: ", "rot ").replace("; baked: none", "")
        md.append(f"| {name} | {r['bits_per_value']:.3f} | {r['bits_per_value'] / 16:.3f} | "
                  f"{_f(r['mean_kld'])} ± {_f(r['kld_se'])} | {r['p99_kld']:.3f} | {100 * r['same_top1']:.1f}% | "
                  f"{r['ppl']:.3f} | {act} |")
    if img:
        md += ["", f"![KLD vs bits/value, {model}]({img})"]
    return md + [""]


def speed_md(d: dict, model: str, img: str | None) -> list[str]:
    meta, rows = d["meta"]["config"], d["rows"]
    depths, pp, tg = meta["depths"], meta["pp"], meta["tg"]
    cols = [f"tg{tg} @ d{x}" for x in depths] + [f"pp{pp} @ d{x}" for x in depths]
    f16, q4 = rows.get("f16"), rows.get("q4_0")
    dev = (f"GPU, {meta['n_gpu_layers']} layers offloaded" if meta.get("n_gpu_layers")
           else f"CPU ({meta['cpu']}, {meta['threads']} threads)")
    md = [f"### Speed and memory: {meta['model']}", "",
          f"{dev}, flash attention on, through the API in one fill per type (module `pykvq.suite.speed`): "
          f"tg{tg} = {tg} single-token decodes at depth d, pp{pp} = one {pp}-token batch at depth d. "
          "Tokens/s with the ratio to f16 and to stock q4_0 from the same run (a converted setting such as "
          "`nuq4@prerope` also to its types unconverted). `f16` decodes through pykvq's "
          "CPU flash attention; `f16 (upstream kernel)` is the same binary with `GGML_KVQ_FA=0`, what stock "
          "llama.cpp runs (its f16 decode accumulates V in f16 and runs scalar for head dims below "
          "GGML_F16_STEP, 128 on AVX512-FP16 CPUs). Peak RSS is the whole process "
          f"at the largest context ({max(depths) + pp + tg} tokens): weights, KV cache and buffers.", "",
          "| cache | KV bytes/token (vs f16) | peak RSS MiB (vs f16) | " + " | ".join(cols) + " |",
          "|---|---|---|" + "---|" * len(cols)]
    for label, r in rows.items():
        kvb = f"{r['kv_bytes_per_token']:,}" + (f" ({r['kv_bytes_per_token'] / f16['kv_bytes_per_token']:.3f}×)"
                                                if f16 else "")
        rss = f"{r['peak_rss_bytes'] / 2**20:.0f}" + (f" ({r['peak_rss_bytes'] / f16['peak_rss_bytes']:.2f}×)"
                                                      if f16 else "")
        cells = []
        for c in cols:
            v = r["tokens_per_s"].get(c)
            rel = []
            if f16 and label != "f16":
                rel.append(f"{v / f16['tokens_per_s'][c]:.2f}× f16")
            if q4 and label not in ("q4_0", "f16"):
                rel.append(f"{v / q4['tokens_per_s'][c]:.2f}× q4_0")
            plain = label.partition("@")[0]       # a converted setting: vs the same types unconverted
            if plain != label and plain not in ("q4_0", "f16") and plain in rows:
                rel.append(f"{v / rows[plain]['tokens_per_s'][c]:.2f}× {plain}")
            cells.append(f"{v:.1f}" + (f" ({', '.join(rel)})" if rel else ""))
        md.append(f"| {label} | {kvb} | {rss} | " + " | ".join(cells) + " |")
    if img:
        md += ["", f"![decode and prefill tokens/s vs depth, {model}]({img})"]
    return md + [""]


def passkey_md(d: dict) -> list[str]:
    meta, rows = d["meta"]["config"], d["rows"]
    lengths = meta["lengths"]
    md = [f"### Passkey retrieval: {meta['model']}", "",
          f"{meta['trials']} trial{'s' if meta['trials'] != 1 else ''} per cache type (the same keys and positions for every type); the key sits "
          "in the first half of the shortest prompt, so at length L it is about L tokens back; greedy answer, "
          "success = its first number is the key (module `pykvq.suite.passkey`).", "",
          "| cache | " + " | ".join(f"{L} tokens" for L in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for label, r in rows.items():
        md.append(f"| {label} | " + " | ".join(f"{100 * r['success'][str(L)]:.0f}%" for L in lengths) + " |")
    return md + [""]


V_TRANSFORM = {"none": "none (upstream's online Hadamard)", "fisher": "none (upstream's online Hadamard)",
               "vhad": "Hadamard baked into W_v/W_o", "vlearned": "learned, output loss",
               "vlearned-fisher": "learned, Fisher loss"}
K_TRANSFORM = {"none": "none (upstream's online Hadamard)", "smooth": "pair smoothing (powers of two)",
               "smooth+klearned": "learned pair scale + angle (from smoothing)"}


def long_md(runs: list[dict], short: dict | None) -> list[str]:
    """The README's settings at long contexts (results/long/eval_<model>_ctx<N>_c<C>.json), beside the 512-token
    matrix's KLD; "× q8_0" is the setting's KLD over stock q8_0's at the same length."""
    runs = sorted(runs, key=lambda d: d["meta"]["config"]["n_ctx"])
    cols = [(f"@{d['meta']['config']['n_ctx']}", d["rows"]) for d in runs]
    if short:
        cols.insert(0, (f"@{short['meta']['config']['n_ctx']}", short["rows"]))
    labels = [lab for lab in runs[0]["rows"] if lab != "f16"]
    md = ["### Long context", "",
          "The README's settings at the context lengths caches are compressed for: KLD against an f16 cache (" +
          "; ".join(f"{d['meta']['config']['chunks']} × {d['meta']['config']['n_ctx']} tokens" for d in runs) +
          f", {runs[0]['meta']['config']['text']}); × q8_0 = the setting's KLD over stock q8_0's at that length.", "",
          "| setting | bits/value | " + " | ".join(f"KLD {c} (× q8_0)" for c, _ in cols) + " | PPL vs f16 " +
          " / ".join(c for c, _ in cols[-len(runs):]) + " |",
          "|---" * (2 + len(cols) + 1) + "|"]
    for lab in labels:
        cells = []
        for _, rows in cols:
            r, q8 = rows.get(lab), rows.get("q8_0")
            cells.append("–" if r is None else f"{_f(r['mean_kld'])}" +
                         (f" ({r['mean_kld'] / q8['mean_kld']:.1f}×)" if q8 and q8["mean_kld"] > 0 else ""))
        ppl = [f"{100 * (d['rows'][lab]['ppl'] / d['rows'][lab]['ppl_base'] - 1):+.1f}%" if lab in d["rows"] else "–"
               for d in runs]
        bits = next(rows[lab]["bits_per_value"] for _, rows in cols if lab in rows)
        md.append(f"| {lab} | {bits:.3f} | " + " | ".join(cells) + " | " + " / ".join(ppl) + " |")
    return md + [""]


def learned_md(d: dict) -> list[str]:
    """The learned-transform comparison (results/learned/eval_<model>.json): V transforms with an f16 K
    cache, per V type; K pair transforms with an f16 V cache."""
    meta, rows = d["meta"]["config"], list(d["rows"].values())
    md = [f"### Learned invertible transforms: {meta['model']}", "",
          f"{meta['text']}, {meta['chunks']} chunks of {meta['n_ctx']} tokens, KLD against the unconverted "
          "model with an f16 cache. V rows keep K in f16 and K rows keep V in f16, so each table isolates one "
          "cache. nuq rows all use Fisher codebooks fitted in their own domain. Conversion time includes "
          "calibration (cached after the first run) and learning on this machine's CPU, and is a wall time "
          "taken while other jobs shared the cores: an upper bound. **bold** = lowest KLD of its type.", ""]
    for which, table, other in (("v", V_TRANSFORM, "k"), ("k", K_TRANSFORM, "v")):
        sel = [r for r in rows if r[other] == "f16" and r[which] != "f16" and r["transform"] in table]
        if not sel:
            continue
        md += [f"| {which.upper()} cache | transform | mean KLD | p99 KLD | same top-1 | PPL | conversion s (CPU) |",
               "|---|---|---|---|---|---|---|"]
        order = list(table)
        types = ("q8_0", "q4_0", "iq4_nl", "bfp4_32", "bfp4_64", "nuq4", "nuq3o", "nuq3", "nuq2o", "nuq2")
        sel.sort(key=lambda r: (types.index(r[which]) if r[which] in types else len(types), r[which],
                                r["rotation"] == "off", order.index(r["transform"])))
        best = {}
        for r in sel:
            best[r[which]] = min(best.get(r[which], 9e9), r["mean_kld"])
        for r in sel:
            name = "none (online rotation off too)" if r["rotation"] == "off" else table[r["transform"]]
            kld = f"{_f(r['mean_kld'])} ± {_f(r['kld_se'])}"
            kld = f"**{kld}**" if r["mean_kld"] == best[r[which]] else kld
            md.append(f"| {r[which]} | {name} | {kld} | {r['p99_kld']:.3f} | "
                      f"{100 * r['same_top1']:.1f}% | {r['ppl']:.3f} | {r.get('convert_seconds', 0):.0f} |")
        md.append("")
    return md


def headline_md(models: dict[str, dict]) -> list[str]:
    md = ["| model | cache | bits/value | KV size vs f16 | mean KLD vs f16 | same top-1 | "
          "decode at depth vs f16 (pykvq kernel / upstream kernel) |",
          "|---|---|---|---|---|---|---|"]
    for model, parts in models.items():
        q, s = parts.get("eval"), parts.get("bench")
        if not q:
            continue
        scol = None
        if s:
            c = s["meta"]["config"]
            scol = f"tg{c['tg']} @ d{max(c['depths'])}"
        for label in HEADLINE:
            r = q["rows"].get(label)
            if not r:
                continue
            dec = "-"
            base_label = bench_label(label, s["rows"]) if s else None
            if base_label and "f16" in s["rows"]:
                sr, fr = s["rows"][base_label]["tokens_per_s"], s["rows"]["f16"]["tokens_per_s"]
                dec = f"{sr[scol] / fr[scol]:.2f}×"
                if UPSTREAM_F16 in s["rows"]:
                    dec += f" / {sr[scol] / s['rows'][UPSTREAM_F16]['tokens_per_s'][scol]:.2f}×"
                dec += f" ({scol.split(' @ ')[1][1:]} tokens)"
            md.append(f"| {model} | {label} | {r['bits_per_value']:.3f} | {r['bits_per_value'] / 16:.3f} | "
                      f"{r['mean_kld']:.4f} | {100 * r['same_top1']:.1f}% | {dec} |")
    return md


README_BEGIN, README_END = "<!-- results:headline -->", "<!-- /results:headline -->"


def update_readme(readme: Path, headline: list[str], docs: Path, models: list[str]) -> None:
    """Replace the README's text between the headline markers (left alone when they are absent)."""
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        return
    rel = docs.resolve().relative_to(readme.resolve().parent) if docs.resolve().is_relative_to(
        readme.resolve().parent) else docs
    body = headline + [""] + [f"![KLD vs bits/value, {m}]({rel}/pareto_{m}.png)" for m in models[:1]]
    body += ["", f"All tables, the speed plots and passkey retrieval: [{rel}/RESULTS.md]({rel}/RESULTS.md)."]
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    tmp = readme.with_suffix(".md.tmp")
    tmp.write_text(head + README_BEGIN + "\n" + "\n".join(body) + "\n" + README_END + tail)
    tmp.replace(readme)


BY_DATE = "RESULTS-BY-DATE.md"   # the sections measured by hand (GPU runs, studies), newest first: never regenerated


def write(results: Path, docs: Path, models: list[str] | None = None, readme: Path | None = None) -> Path:
    """Write docs/RESULTS.md and docs/*.png from results/{eval,bench,passkey}_<model>.json (and the
    README's headline between its markers, when a README is given)."""
    found: dict[str, dict] = {}
    for kind in ("eval", "bench", "passkey"):
        for p in sorted(results.glob(f"{kind}_*.json")):
            if p.name.endswith(".stale.json"):
                continue
            model = p.stem[len(kind) + 1:]
            if models is None or model in models:
                found.setdefault(model, {})[kind] = load(p)
    docs.mkdir(parents=True, exist_ok=True)
    out = docs / "RESULTS.md"
    md = ["# pykvq: measured results", "",
          f"Generated by `pykvq report` on {datetime.date.today().isoformat()} from `{results.name}/*.json`; "
          "regenerate everything with `make results` (`pykvq results`). Every ratio is to a row of the same "
          "run on the same machine. The studies and GPU runs measured by hand, newest first, are in "
          f"[{BY_DATE}]({BY_DATE}).", ""]
    md += ["## Headline", ""]
    headline = headline_md(found)
    md += headline + [""]
    for model, parts in found.items():
        md += [f"## {model}", ""]
        if "eval" in parts:
            img = f"pareto_{model}.png"
            plot_pareto(list(parts["eval"]["rows"].values()), parts["eval"]["meta"]["config"], docs / img)
            md += quality_md(parts["eval"], model, img)
        if "bench" in parts:
            img = f"speed_{model}.png"
            plot_speed(list(parts["bench"]["rows"].values()), parts["bench"]["meta"]["config"], docs / img)
            md += speed_md(parts["bench"], model, img)
        if "passkey" in parts:
            md += passkey_md(parts["passkey"])
        long_runs = [d for d in (load(p) for p in sorted((results / "long").glob(f"eval_{model}_ctx*.json"))
                                 if not p.name.endswith(".stale.json")) if d and d["rows"]]
        if long_runs:
            md += long_md(long_runs, parts.get("eval"))
        learned = results / "learned" / f"eval_{model}.json"
        if learned.is_file():
            md += learned_md(load(learned))
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text("\n".join(md) + "\n")
    tmp.replace(out)
    if readme is not None and readme.is_file():
        update_readme(readme, headline, docs, [m for m in found if "eval" in found[m]])
    return out
