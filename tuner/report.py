"""The evidence behind the decision table as Markdown with PNG plots (matplotlib, Agg).

For every decision key: time against batch size at each context length per
backend (log-log), a heatmap of each backend's time relative to the best at
that shape, and the decision with its margin. Per SKU and KV dtype: each
backend's score against heads per rank, with anomalies (a backend that
departs from its trend at one head count, the TP=2 pattern) circled in red.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from mla_tune.backends.engine_names import vllm_gap, vllm_regret
from mla_tune.store.records import Decision, DecisionKey, Measurement

_FAILED_MARK = "x"


def _slug(key: DecisionKey) -> str:
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:8]
    sparse = f"-topk{key.topk}" if key.topk else ""
    return f"{key.kv_cache_dtype}-h{key.num_heads}-p{key.page_size}{sparse}-q{key.q_len}-{digest}"


def shape_times_ms(measurements: Iterable[Measurement]) -> dict[str, dict[tuple[int, int], float]]:
    """backend -> {(batch_size, kv_len): median over GPUs of median_ms} for `ok` measurements."""
    grouped: dict[str, dict[tuple[int, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    for m in measurements:
        if m.status == "ok" and m.median_ms is not None and m.median_ms > 0:
            grouped[m.backend][(m.batch_size, m.kv_len)].append(m.median_ms)
    return {b: {s: statistics.median(v) for s, v in shapes.items()} for b, shapes in grouped.items()}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ratio_ticks(top: float) -> list[float]:
    """Readable ticks for a ratio axis that starts at 1."""
    return [t for t in (1, 1.1, 1.25, 1.5, 2, 3, 5, 10, 20, 50, 100) if t <= top * 1.0001]


def _plain_log_axis(axis, ticks) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    axis.set_major_locator(FixedLocator(list(ticks)))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _colors(backends: list[str]) -> dict[str, tuple]:
    plt = _pyplot()
    cmap = plt.get_cmap("tab10")
    return {b: cmap(i % 10) for i, b in enumerate(sorted(backends))}


def plot_times(key: DecisionKey, times: dict[str, dict[tuple[int, int], float]], path: Path, *,
               winner: str | None = None) -> Path:
    """Time per decode step against batch size, one panel per KV length, one line per backend."""
    plt = _pyplot()
    kv_lens = sorted({s[1] for shapes in times.values() for s in shapes})
    colors = _colors(list(times))
    cols = min(len(kv_lens), 3) or 1
    rows = math.ceil(len(kv_lens) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False, sharey=True)
    for ax, kv_len in zip(axes.flat, kv_lens):
        for backend in sorted(times):
            points = sorted((b, t) for (b, k), t in times[backend].items() if k == kv_len)
            if not points:
                continue
            width = 2.6 if backend == winner else 1.4
            ax.plot([p[0] for p in points], [p[1] * 1000 for p in points], marker="o", ms=4,
                    lw=width, color=colors[backend], label=backend + (" (chosen)" if backend == winner else ""))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        _plain_log_axis(ax.xaxis, sorted({s[0] for shapes in times.values() for s in shapes}))
        ax.set_title(f"kv_len {kv_len:,} tokens", fontsize=10)
        ax.set_xlabel("batch size (requests)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("time per decode step (µs)")
    for ax in list(axes.flat)[len(kv_lens):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=9, frameon=False)
    fig.suptitle(f"{key.sku}\n{key.label}", fontsize=10)
    fig.tight_layout(rect=(0, 0.08 if len(labels) <= 4 else 0.13, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_relative(key: DecisionKey, times: dict[str, dict[tuple[int, int], float]], path: Path, *,
                  decision: Decision | None = None, failed: Iterable[str] = ()) -> Path:
    """Heatmap: each backend's time / the best time at that shape; failed backends as a grey row."""
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    shapes = sorted({s for shapes in times.values() for s in shapes}, key=lambda s: (s[1], s[0]))
    backends = sorted(times, key=lambda b: (decision.scores.get(b, math.inf) if decision else 0, b))
    backends += sorted(set(failed) - set(backends))
    best = {s: min(t[s] for t in times.values() if s in t) for s in shapes}
    grid = np.full((len(backends), len(shapes)), np.nan)
    for i, backend in enumerate(backends):
        for j, shape in enumerate(shapes):
            if shape in times.get(backend, {}):
                grid[i, j] = times[backend][shape] / best[shape]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(shapes) + 3.5), 0.55 * len(backends) + 2.2))
    top = max(2.0, float(np.nanmax(grid)) if np.isfinite(grid).any() else 2.0)
    cmap = plt.get_cmap("RdYlGn_r").copy()
    cmap.set_bad("#d9d9d9")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=LogNorm(vmin=1.0, vmax=top), aspect="auto")
    norm = image.norm
    for i in range(len(backends)):
        for j in range(len(shapes)):
            value = grid[i, j]
            text = _FAILED_MARK if not np.isfinite(value) else f"{value:.2f}"
            color = "black"
            if np.isfinite(value):
                r, g, b, _ = cmap(float(norm(value)))
                color = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color=color)
    ax.set_xticks(range(len(shapes)), [f"b{b}\n{k // 1024}k" if k >= 1024 else f"b{b}\n{k}" for b, k in shapes],
                  fontsize=7)
    labels = [b + (" *" if decision and b == decision.winner else "") for b in backends]
    ax.set_yticks(range(len(backends)), labels, fontsize=8)
    ax.set_xlabel("shape (batch size, kv_len in tokens)")
    bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    bar.set_label("time / best time at the shape (1 = fastest)")
    _plain_log_axis(bar.ax.yaxis, _ratio_ticks(top))
    title = f"{key.label}: relative time ({_FAILED_MARK} = no valid time, * = chosen)"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_heads(sku: str, kv_cache_dtype: str, decisions: list[Decision], path: Path) -> Path:
    """Each backend's score against heads per rank for one SKU and KV dtype; anomalies circled."""
    plt = _pyplot()
    decisions = sorted(decisions, key=lambda d: d.key.num_heads)
    backends = sorted({b for d in decisions for b in d.scores})
    colors = _colors(backends)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for backend in backends:
        points = [(d.key.num_heads, d.scores[backend]) for d in decisions if backend in d.scores]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=colors[backend], label=backend)
        for d in decisions:
            if backend in d.scores and any(backend in a for a in d.anomalies):
                ax.scatter([d.key.num_heads], [d.scores[backend]], s=260, facecolors="none",
                           edgecolors="red", linewidths=2, zorder=5)
    if any(d.anomalies for d in decisions):
        ax.scatter([], [], s=160, facecolors="none", edgecolors="red", linewidths=2, label="anomaly")
    ax.set_xscale("log", base=2)
    heads = [d.key.num_heads for d in decisions]
    _plain_log_axis(ax.xaxis, heads)
    ax.set_yscale("log")
    top = max((s for d in decisions for s in d.scores.values()), default=2.0)
    _plain_log_axis(ax.yaxis, _ratio_ticks(max(top, 1.1)))
    ax.set_xlabel("query heads per rank (model heads / TP)")
    ax.set_ylabel("score (geo-mean of time / best; 1 = best)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(f"{sku}\nKV {kv_cache_dtype}: backend score by head count", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _decision_lines(d: Decision) -> list[str]:
    margin = f"{d.margin * 100:.1f}%" if d.margin is not None else "n/a"
    lines = [f"- **Chosen: `{d.winner}`**; runner-up `{d.runner_up or '-'}` at +{margin}; "
             f"vLLM static choice `{d.static_choice or '-'}`"
             + (f" (score {d.static_score:.3f})" if d.static_score is not None else "")
             + ("; kept within the noise margin" if d.kept_static else "")
             + f"; noise margin {d.noise_margin * 100:.1f}%."]
    lines.append(f"- vLLM gets: {vllm_regret(d)} (its fastest own backend; times relative to the fastest "
                 f"kernel and to vLLM's best).")
    gap = vllm_gap(d)
    if gap is not None and gap.plugin and d.engine_best is not None:
        from mla_tune.engines import decision_for_engine

        picked = decision_for_engine(d, "vllm", plugin_missing=None)
        lines.append(f"- With mla-tune's vLLM plugin, vLLM gets `{picked.engine_backend or '-'}`: {picked.reason}.")
    if d.scores:
        ranked = sorted(d.scores.items(), key=lambda kv: (kv[1], kv[0]))
        lines.append("- Scores: " + ", ".join(f"`{b}` {s:.3f}" for b, s in ranked) + ".")
    for anomaly in d.anomalies:
        lines.append(f"- ⚠️ **Anomaly:** {anomaly}")
    for backend, why in sorted(d.failures.items()):
        lines.append(f"- `{backend}` could not win: {why}")
    if d.gpu_uuids:
        lines.append(f"- Measured on {len(d.gpu_uuids)} GPU(s); decided {d.decided_at or 'at an unknown time'}.")
    return lines


def engine_table_lines(groups: dict[tuple[str, str, int], list[Decision]]) -> list[str]:
    """Per SKU, KV dtype and sparsity, one row per head count: the fastest kernel, vLLM's fastest own
    backend and its time relative to the fastest, vLLM's static choice relative to vLLM's best, and our kernel
    as vLLM launches it through mla-tune's plugin (where it is the fastest) relative to the fastest."""
    lines = ["## What vLLM gets, by heads per rank", "",
             "| GPU SKU | KV | heads | fastest | vLLM's best (x fastest) | vLLM static (x vLLM's best) "
             "| ours as vLLM launches it (x fastest) |",
             "|---|---|---|---|---|---|---|"]
    for (sku, kv, topk), group in sorted(groups.items()):
        sku_cell = sku.replace("|", "\\|")  # a SKU names its fields with `|`, which would split the cell
        for d in sorted(group, key=lambda d: d.key.num_heads):
            gap = vllm_gap(d)
            if gap is None:
                continue
            best_text = f"`{gap.best}` {gap.best_over_fastest:.2f}x" if gap.best else (
                "not timed" if d.engine_best is None else "-")
            static_text = (f"`{gap.static}` {gap.static_over_best:.2f}x" if gap.static_over_best is not None
                           else f"`{gap.static}` not timed" if gap.static else "-")
            plugin_text = "-" if not gap.plugin else (
                f"`{gap.plugin}` {gap.plugin_over_fastest:.2f}x" if gap.plugin_over_fastest is not None
                else f"`{gap.plugin}` not timed")
            lines.append(f"| {sku_cell} | {kv}{f' top-k {topk}' if topk else ''} | {d.key.num_heads} | "
                         f"`{gap.fastest}` | {best_text} | {static_text} | {plugin_text} |")
    return lines + [""] if len(lines) > 4 else []


def write_report(decisions: Iterable[Decision], measurements: Iterable[Measurement], out_dir: str | Path,
                 *, title: str = "mla-tune report") -> Path:
    """Write `index.md` and its PNGs into `out_dir`; return the Markdown path.

    Args:
        decisions: the decisions to report (one section per SKU, one entry per key).
        measurements: their evidence; measurements of keys without a decision are ignored.
        out_dir: created if missing; existing files of the same names are replaced.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    decisions = sorted(decisions, key=lambda d: (d.key.sku, d.key.kv_cache_dtype, d.key.topk,
                                                  d.key.num_heads, d.key.page_size, d.key.q_len))
    by_key: dict[DecisionKey, list[Measurement]] = defaultdict(list)
    for m in measurements:
        by_key[m.key].append(m)
    lines = [f"# {title}", "", f"{len(decisions)} decision(s).", ""]
    if not decisions:
        lines.append("Nothing is tuned yet: run `mla-tune` on a GPU node, or `mla-tune import FILE`.")
    anomalies = [(d, a) for d in decisions for a in d.anomalies]
    if anomalies:
        lines += ["## Anomalies", ""] + [f"- ⚠️ {d.key.sku}, {d.key.label}: {a}" for d, a in anomalies] + [""]
    current_sku = None
    groups: dict[tuple[str, str, int], list[Decision]] = defaultdict(list)
    for d in decisions:
        groups[(d.key.sku, d.key.kv_cache_dtype, d.key.topk)].append(d)
        if d.key.sku != current_sku:
            current_sku = d.key.sku
            lines += [f"## {current_sku}", ""]
        lines += [f"### {d.key.label}", ""] + _decision_lines(d) + [""]
        times = shape_times_ms(by_key.get(d.key, []))
        if times:
            slug = _slug(d.key)
            failed = {m.backend for m in by_key[d.key] if m.status in ("failed", "incorrect", "timeout")}
            plot_times(d.key, times, out / f"{slug}-time.png", winner=d.winner)
            plot_relative(d.key, times, out / f"{slug}-relative.png", decision=d, failed=failed)
            lines += [f"![time against batch size]({slug}-time.png)", "",
                      f"![time relative to the best]({slug}-relative.png)", ""]
        else:
            lines += ["No per-shape measurements stored for this key.", ""]
    heads_lines = []
    for (sku, kv, topk), group in sorted(groups.items()):
        if len({d.key.num_heads for d in group}) >= 2:
            digest = hashlib.sha256(f"{sku}|{kv}|{topk}".encode()).hexdigest()[:8]
            name = f"heads-{kv}{f'-topk{topk}' if topk else ''}-{digest}.png"
            plot_heads(sku, kv + (f" top-k {topk}" if topk else ""), group, out / name)
            heads_lines += [f"### {sku}, KV {kv}{f' top-k {topk}' if topk else ''}", "",
                            f"![score by head count]({name})", ""]
    lines += engine_table_lines(groups)
    if heads_lines:
        lines += ["## Scores across head counts", ""] + heads_lines
    path = out / "index.md"
    path.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    return path
