"""Recovered fractions of several QAT-vs-PTQ runs (one results.json per seed): per seed, mean, spread, min and max.

    python bench/qat_seeds.py bench/results/2026-11-24-h200-qat-scratch/results.json \
        bench/results/2026-11-24-h200-qat-scratch-seed1/results.json ... --out bench/results/<dir>/summary.md

For every QAT scheme found in all the runs and every metric that bench/qat_common.compare_arms records
(token and word perplexity; converted models and fake-quant ones) it prints one row: the recovered fraction of
each run, their mean, sample standard deviation, minimum and maximum. Writes the table as markdown to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

METRICS = [("recovered_word_ppl", "word ppl, converted"), ("recovered_token_ppl", "token ppl, converted"),
           ("recovered_fake_word_ppl", "word ppl, fake-quant"), ("recovered_fake_token_ppl", "token ppl, fake-quant")]


def load(paths: list[str]) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in paths]


def summary_rows(runs: list[dict]) -> list[dict]:
    """One dict per (scheme, metric): values per run (None where undefined), mean, stdev, min, max."""
    schemes = [s for s in runs[0]["qat"] if all(s in r["qat"] for r in runs)]
    rows = []
    for scheme in schemes:
        for key, label in METRICS:
            values = [r["qat"][scheme].get(key) for r in runs]
            defined = [v for v in values if v is not None]
            rows.append({"scheme": scheme, "metric": label, "values": values,
                         "mean": statistics.fmean(defined) if defined else None,
                         "stdev": statistics.stdev(defined) if len(defined) > 1 else None,
                         "min": min(defined, default=None), "max": max(defined, default=None)})
    return rows


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def markdown(runs: list[dict], rows: list[dict]) -> str:
    seeds = [str(r["config"].get("seed", "?")) for r in runs]
    head = " | ".join(f"seed {s}" for s in seeds)
    lines = [f"| scheme | recovered, on | {head} | mean | std (sample) | min – max |",
             "|---|---|" + "---:|" * len(seeds) + "---:|---:|---:|"]
    for row in rows:
        cells = " | ".join(_pct(v) for v in row["values"])
        std = "n/a" if row["stdev"] is None else f"{100 * row['stdev']:.1f} pts"
        lines.append(f"| {row['scheme']} | {row['metric']} | {cells} | **{_pct(row['mean'])}** | {std} | "
                     f"{_pct(row['min'])} – {_pct(row['max'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="results.json files of bench/qat_vs_ptq.py or bench/qat_smollm2.py")
    p.add_argument("--out", default=None, help="write the markdown table here")
    a = p.parse_args()
    runs = load(a.results)
    text = markdown(runs, summary_rows(runs))
    print(text, end="")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
