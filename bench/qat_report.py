"""Markdown tables and the perplexity-vs-group-size plot of a QAT-vs-PTQ results.json (bench/qat_*.py)."""

from __future__ import annotations

from pathlib import Path

GROUPS = [32, 64, 128, 256]


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def markdown_tables(results: dict) -> str:
    """PTQ sweep of the base model; QAT vs PTQ vs control with the recovered fractions; bytes of each model."""
    base, ctrl = results["base"], results["control"]["fp32"]
    lines = ["| scheme (PTQ, round to nearest, converted) | token ppl | word ppl | token ppl vs full precision |",
             "|---|---:|---:|---:|",
             f"| full precision | {base['fp32']['token_ppl']:.4f} | {base['fp32']['word_ppl']:.3f} | |"]
    for name, r in base["ptq"].items():
        rel = 100 * (r["token_ppl"] / base["fp32"]["token_ppl"] - 1)
        lines.append(f"| {name} | {r['token_ppl']:.4f} | {r['word_ppl']:.3f} | {rel:+.2f}% |")
    for name, r in base.get("ptq_gptq", {}).items():
        rel = 100 * (r["token_ppl"] / base["fp32"]["token_ppl"] - 1)
        lines.append(f"| {name}, GPTQ | {r['token_ppl']:.4f} | {r['word_ppl']:.3f} | {rel:+.2f}% |")
    fake_ptq = results["control"].get("ptq_fake", {})
    lines += ["", "| scheme | control (full-precision fine-tune) | PTQ of control (converted / fake-quant) "
              "| QAT (converted / fake-quant) | PTQ loss vs control | recovered, token ppl (converted / fake-quant) "
              "| recovered, word ppl (converted) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results["qat"].items():
        p = results["control"]["ptq"][name]
        pf = fake_ptq.get(name, p)
        loss = 100 * (p["token_ppl"] / ctrl["token_ppl"] - 1)
        lines.append(f"| {name} | {ctrl['token_ppl']:.4f} | {p['token_ppl']:.4f} / {pf['token_ppl']:.4f} "
                     f"| {r['converted']['token_ppl']:.4f} / {r['fake_quant']['token_ppl']:.4f} | {loss:+.2f}% "
                     f"| {_pct(r['recovered_token_ppl'])} / {_pct(r.get('recovered_fake_token_ppl'))} "
                     f"| {_pct(r['recovered_word_ppl'])} |")
    gptq = results["control"].get("ptq_gptq", {})
    if gptq:
        lines += ["", "| scheme | control | PTQ of control: round to nearest / GPTQ | QAT (converted) "
                  "| GPTQ wins back of RTN's loss, token / word ppl | QAT wins back of GPTQ's loss, token / word ppl |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, g in gptq.items():
            r, p = results["qat"][name], results["control"]["ptq"][name]
            lines.append(f"| {name} | {ctrl['token_ppl']:.4f} | {p['token_ppl']:.4f} / {g['token_ppl']:.4f} "
                         f"| {r['converted']['token_ppl']:.4f} | {_pct(r.get('gptq_recovered_token_ppl'))} / "
                         f"{_pct(r.get('gptq_recovered_word_ppl'))} | {_pct(r.get('recovered_vs_gptq_token_ppl'))} / "
                         f"{_pct(r.get('recovered_vs_gptq_word_ppl'))} |")
    if "bytes" in results:
        lines += ["", "| model | bytes on disk (checkpoint) | bytes in memory (all tensors) | vs bf16 "
                  "| block linears (weights + scales + zero points) | vs bf16 |", "|---|---:|---:|---:|---:|---:|"]
        bf16 = results["bytes"]["bf16"]
        for name, b in results["bytes"].items():
            lin = b.get("block_linear_bytes")
            lin_text = "" if lin is None else f"{lin:,} | {lin / bf16['block_linear_bytes']:.3f}"
            lines.append(f"| {name} | {b['disk_bytes']:,} | {b['memory_bytes']:,} | "
                         f"{b['memory_bytes'] / bf16['memory_bytes']:.3f} | {lin_text} |")
    return "\n".join(lines) + "\n"


def _group(name: str) -> int | None:
    return int(name.split("-g")[1].split("-")[0]) if "-g" in name else None


def plot(results: dict, path: Path, title: str) -> None:
    """Held-out token perplexity vs group size: PTQ of the base per scheme family, QAT and PTQ of the control."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (redo it with --from-results on a machine that has it)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    base = results["base"]
    for kind, style in (("int4-g{}", "o-"), ("int4-g{}-asym", "s--"), ("8da4w-g{}", "^-")):
        pts = [(g, base["ptq"][kind.format(g)]["token_ppl"]) for g in GROUPS if kind.format(g) in base["ptq"]]
        if pts:
            ax.plot(*zip(*pts), style, label="PTQ " + kind.format("G") + " of the base model")
    if "int8" in base["ptq"]:
        ax.axhline(base["ptq"]["int8"]["token_ppl"], color="gray", ls=":", label="PTQ int8 (per channel) of the base")
    ax.axhline(base["fp32"]["token_ppl"], color="black", label="base model, full precision")
    ax.axhline(results["control"]["fp32"]["token_ppl"], color="black", ls="--",
               label="full-precision fine-tune (control)")
    for name, r in results["qat"].items():
        g = _group(name)
        ax.plot([g], [r["converted"]["token_ppl"]], "*", ms=13, label=f"QAT {name}, converted")
        ax.plot([g], [results["control"]["ptq"][name]["token_ppl"]], "x", ms=10, label=f"PTQ {name} of the control")
        if name in results["control"].get("ptq_gptq", {}):
            ax.plot([g], [results["control"]["ptq_gptq"][name]["token_ppl"]], "+", ms=12,
                    label=f"GPTQ {name} of the control")
    ax.set_xscale("log", base=2)
    ax.set_xticks(GROUPS, [str(g) for g in GROUPS])
    ax.set_xlabel("group size (input features per scale); int4 weights")
    ax.set_ylabel("held-out token perplexity")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")
