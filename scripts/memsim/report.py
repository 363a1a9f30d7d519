"""The simulator's text report and figures (concurrency.png, waste.png, block_size.png)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .trace import SimConfig


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def print_report(cfg: SimConfig, report: dict) -> None:
    t, res, rat = report["trace"], report["strategies"], report["ratios"]
    print(f"trace: {t['requests']} requests ({t['parallel_requests']} with n={cfg.parallel_n}, "
          f"{t['sequences']} sequences), prompt mean/p99/max {t['prompt_mean']:.0f}/{t['prompt_p99']:.0f}/"
          f"{t['prompt_max']}, output mean/p99/max {t['output_mean']:.0f}/{t['output_p99']:.0f}/{t['output_max']}")
    print(f"budget: {cfg.budget_tokens:,} token slots = {_gib(cfg.budget_tokens * cfg.kv_bytes_per_token)} "
          f"at {cfg.kv_bytes_per_token // 1024} KiB/token; max_model_len {cfg.max_model_len}, "
          f"block_size {cfg.block_size}")
    print(f"{'strategy':<13}{'peak req':>9}{'mean req':>9}{'x static':>9}{'written':>9}{'int.waste':>10}"
          f"{'of rsvd':>8}{'ext.frag':>9}{'free':>7}{'copied':>12}{'hit rate':>9}{'preempt':>8}{'steps':>7}{'x tok/s':>8}")
    for name, r in res.items():
        print(f"{name:<13}{r['peak_requests']:>9}{r['mean_requests']:>9.1f}{rat[name]['mean_requests']:>8.1f}x"
              f"{r['written_pct']:>8.1f}%{r['internal_waste_pct']:>9.1f}%{r['internal_waste_of_reserved_pct']:>7.1f}%"
              f"{r['ext_frag_pct']:>8.1f}%"
              f"{r['free_pct']:>6.1f}%{_gib(r['bytes_copied']):>12}{r['prefix_hit_rate']:>9.1%}"
              f"{r['preemptions']:>8}{r['steps']:>7}{rat[name]['tokens_per_step']:>7.1f}x")
    h = res["paged+host"]
    print(f"paged+host: {h['host_hit_rate']:.1%} of looked-up prompt tokens came from the host tier "
          f"({cfg.host_budget_x:g}x the device blocks, {cfg.host_policy}); {_gib(h['host_bytes_copied'])} copied "
          "between the tiers")
    print("block-size sweep (paged+prefix):")
    print(f"{'block':>7}{'int.waste':>10}{'entries/seq':>12}{'row width':>10}{'hit rate':>9}{'mean req':>9}"
          f"{'copied':>12}")
    for row in report["sweep"]:
        print(f"{row['block_size']:>7}{row['internal_waste_pct']:>9.2f}%{row['block_table_entries_per_seq']:>12.1f}"
              f"{row['block_table_width']:>10}{row['prefix_hit_rate']:>9.1%}{row['mean_requests']:>9.1f}"
              f"{_gib(row['bytes_copied']):>12}")
    p, tg = res["paged+prefix"], report["targets"]
    print(f"target: paged+prefix internal waste {p['internal_waste_pct']:.2f}% of the pool < 2%: "
          f"{'met' if tg['waste_below_2pct'] else 'NOT met'}")
    print(f"target: paged+prefix concurrent requests vs static at max_model_len {cfg.max_model_len}: "
          f"peak {rat['paged+prefix']['peak_requests']:.1f}x, mean {rat['paged+prefix']['mean_requests']:.1f}x "
          f"(>= 4x): {'met' if tg['peak_requests_4x_static'] and tg['mean_requests_4x_static'] else 'NOT met'}")


COLORS = {"static": "#7f7f7f", "doubling": "#d62728", "paged": "#1f77b4", "paged+prefix": "#2ca02c",
          "paged+host": "#9467bd"}


def plot(report: dict, series: dict[str, list[int]], out: Path) -> list[Path]:
    """Writes concurrency.png, waste.png and block_size.png into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, paths = report["strategies"], []

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, ys in series.items():
        k = max(1, len(ys) // 4000)  # every k-th step keeps the PNG small
        ax.plot(range(0, len(ys), k), ys[::k], lw=0.9, color=COLORS[name], label=name)
    ax.set(xlabel="step (one decode token per running sequence)", ylabel="running requests",
           title="Concurrent requests under the same KV budget (same trace)")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "concurrency.png"))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    names = list(res)
    labels = [f"{n}\n{_gib(res[n]['bytes_copied'])} copied" + (
        f"\n+ {_gib(res[n]['host_bytes_copied'])} to/from host" if res[n].get("host_bytes_copied") else "")
        for n in names]
    parts = [("written KV", [res[n]["written_pct"] for n in names], "#2ca02c"),
             ("internal waste", [res[n]["internal_waste_pct"] for n in names], "#d62728"),
             ("free, fragmented", [res[n]["ext_frag_pct"] for n in names], "#ff7f0e"),
             ("free", [res[n]["free_pct"] - res[n]["ext_frag_pct"] for n in names], "#c7c7c7")]
    bottom = np.zeros(len(names))
    for label, vals, color in parts:
        a1.bar(labels, vals, bottom=bottom, color=color, label=label)
        bottom += vals
    a1.set(ylabel="% of KV pool (mean over saturated steps)", ylim=(0, 114), title="Where the KV memory goes")
    a1.set_yticks(range(0, 101, 20))
    a1.legend(fontsize=8, loc="upper center", ncol=4, handlelength=1)
    a1.tick_params(axis="x", labelsize=8)
    x = np.arange(len(names))
    a2.bar(x - 0.2, [res[n]["mean_requests"] for n in names], 0.4, label="mean", color="#1f77b4")
    a2.bar(x + 0.2, [res[n]["peak_requests"] for n in names], 0.4, label="peak", color="#aec7e8")
    for i, n in enumerate(names):
        a2.text(i - 0.2, res[n]["mean_requests"], f"{report['ratios'][n]['mean_requests']:.1f}x",
                ha="center", va="bottom", fontsize=8)
    a2.set_xticks(x, [n.replace("+", "\n+") for n in names], fontsize=8)
    a2.set(ylabel="concurrent requests", title="Batch size (x = mean vs static)")
    a2.legend(fontsize=8)
    paths.append(_save(fig, out / "waste.png"))

    sw = report["sweep"]
    fig, ax = plt.subplots(figsize=(7, 4))
    bss = [r["block_size"] for r in sw]
    ax.plot(bss, [r["internal_waste_pct"] for r in sw], "o-", color="#d62728", label="internal waste (% of pool)")
    ax.set(xscale="log", xlabel="block size (tokens)", ylabel="internal waste, % of pool",
           title="Block size: waste against block-table size (paged+prefix)")
    ax.set_xticks(bss, [str(b) for b in bss])
    ax.minorticks_off()
    ax2 = ax.twinx()
    ax2.plot(bss, [r["block_table_entries_per_seq"] for r in sw], "s--", color="#1f77b4",
             label="block-table entries per sequence (mean)")
    ax2.set(yscale="log", ylabel="block-table entries per sequence")
    fig.legend(loc="upper center", bbox_to_anchor=(0.45, 0.86), fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / "block_size.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
