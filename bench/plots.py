"""PNG plots of `fdserve bench` results (matplotlib, headless Agg backend).

latency / concurrency: one bar per variant (unavailable ones shown as "n/a"), the speed-up
over `standard` written on each bar. serve: output tokens/s, TTFT and TPOT against the
concurrency level, p50 solid and p99 dashed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _subtitle(result: dict[str, Any]) -> str:
    s = result["settings"]
    parts = [f"model {result['model']}"]
    if "context_len" in s:
        parts.append(f"context {s['context_len']}, {s['max_tokens']} tokens")
    if result.get("machine"):
        parts.append(result["machine"]["device"])
    return "; ".join(parts)


def plot_variants(result: dict[str, Any], path: Path) -> Path:
    latency = result["mode"] == "latency"
    key, label = ("tpot_ms", "decode latency (ms/token, lower is better)") if latency else \
        ("tok_s", "generated tokens/s in total (higher is better)")
    rows = result["variants"]
    names = [r["name"] for r in rows]
    values = [r[key] if r["available"] and r[key] is not None else 0.0 for r in rows]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * len(rows) + 2), 4))
    bars = ax.bar(names, values, color=["#777777" if n == "standard" else "#2a7ab0" for n in names])
    for bar, row in zip(bars, rows, strict=True):
        if not row["available"]:
            text = "n/a"
        else:
            speedup = row.get("speedup_vs_standard")
            text = f"{row[key]:.2f}" + (f"\n{speedup:.2f}x" if speedup else "")
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylabel(label)
    ax.set_ylim(0, max(values + [1e-9]) * 1.3)
    title = "per-token latency" if latency else f"{result['settings'].get('num_requests')} concurrent requests"
    ax.set_title(f"fdserve bench {result['mode']}: {title}\n{_subtitle(result)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_serve(result: dict[str, Any], path: Path) -> Path:
    levels = result["levels"]
    conc = [lv["concurrency"] for lv in levels]
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].plot(conc, [lv["output_tok_s"] for lv in levels], marker="o")
    axes[0].set_ylabel("output tokens/s")
    for ax, metric in ((axes[1], "ttft"), (axes[2], "tpot")):
        for q, style in (("p50", "-"), ("p99", "--")):
            ys = [lv[f"{metric}_ms_{q}"] for lv in levels]
            ax.plot(conc, [float("nan") if y is None else y for y in ys], style, marker="o", label=q)
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_xlabel("concurrent requests")
        ax.grid(alpha=0.3)
    s = result["settings"]
    fig.suptitle(f"fdserve bench serve: {result['model']} at {result['url']}, prompt ~{s['prompt_len']} tokens, "
                 f"{s['max_tokens']} generated", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_result(result: dict[str, Any], path: Path) -> Path:
    """Write the plot for any `fdserve bench` result to `path` (PNG) and return it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if result["mode"] == "prefill":
        return plot_prefill(result, path)
    return plot_serve(result, path) if result["mode"] == "serve" else plot_variants(result, path)


def plot_prefill(result: dict[str, Any], path: Path) -> Path:
    """TTFT against prompt length per variant (log-log), and each over transformers where measured."""
    rows = [r for r in result["variants"] if r["available"]]
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        xs = [p["context_len"] for p in row["points"]]
        axes[0].plot(xs, [p["ttft_ms"] / 1e3 for p in row["points"]], marker="o", label=row["name"])
        ratios = [p.get("ttft_vs_transformers") for p in row["points"]]
        if any(ratios):
            axes[1].plot(xs, [float("nan") if r is None else r for r in ratios], marker="o", label=row["name"])
    axes[0].set_ylabel("time to first token (s)")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("TTFT / transformers TTFT (lower is faster)")
    axes[1].axhline(1.0, color="#777777", lw=0.8)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"fdserve bench prefill: model {result['model']}; {result['machine']['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
