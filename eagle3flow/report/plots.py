"""The report's figures, one PNG per question a user asks of a draft.

Each function takes already-loaded data (see eagle3flow/report/render.py for where it comes
from) and writes one PNG. With no data for a panel the figure says so in words
instead of failing, so a report is always complete (e.g. a resumed extraction that
computed nothing has no throughput to show).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on compute nodes and in CI
import matplotlib.pyplot as plt  # noqa: E402

DPI = 110


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_training(metrics: list[dict], path) -> Path:
    """Loss and per-TTT-step accuracy over optimizer steps (results/train/metrics.jsonl)."""
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4))
    if not metrics:
        _no_data(loss_ax, "training metrics")
        _no_data(acc_ax, "training metrics")
        return _save(fig, path)
    steps = [m["step"] for m in metrics]
    loss_ax.plot(steps, [m["loss"] for m in metrics], color="black")
    loss_ax.set(title="training loss (TTT-weighted)", xlabel="optimizer step", ylabel="loss")
    loss_ax.grid(alpha=0.3)
    num_steps = len(metrics[0].get("step_acc") or [])
    cmap = plt.get_cmap("viridis", max(num_steps, 2))
    for j in range(num_steps):
        acc_ax.plot(steps, [m["step_acc"][j] for m in metrics], color=cmap(j), label=f"step {j + 1}")
    acc_ax.set(title="per-step accuracy (draft argmax = target argmax)", xlabel="optimizer step",
               ylabel="accuracy", ylim=(0, 1))
    acc_ax.grid(alpha=0.3)
    if num_steps:
        acc_ax.legend(fontsize=8, ncol=2)
    return _save(fig, path)


def plot_acceptance_per_position(summary: dict, path) -> Path:
    """vLLM's acceptance rate at each draft position, per prompt set and draft (solid),
    with the replay's (dotted)."""
    results = summary.get("results") or {}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    plotted = 0
    for set_name, by_draft in results.items():
        for draft, r in by_draft.items():
            rates = r["vllm"]["acceptance_rate_per_position"]
            xs = list(range(1, len(rates) + 1))
            line, = ax.plot(xs, rates, marker="o", label=f"{set_name} / {draft} (vLLM)")
            if r["simulated"]:
                ax.plot(xs, r["simulated"]["acceptance_rate_per_position"], linestyle=":",
                        color=line.get_color(), label=f"{set_name} / {draft} (replay)")
            plotted += 1
    if not plotted:
        _no_data(ax, "acceptance")
    else:
        ax.set(title="acceptance per draft position", xlabel="draft position",
               ylabel="accepted / drafts", ylim=(0, 1.05))
        ax.set_xticks(range(1, len(rates) + 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_acceptance_vs_k(summary: dict, path) -> Path:
    """Acceptance length against the number of speculative tokens K: the exact replay
    for every K up to the TTT steps (lines), vLLM at the Ks it was run (points), and
    vLLM's speedup at those Ks (right axis) where a sweep ran."""
    results = summary.get("results") or {}
    sweep = summary.get("vllm_k_sweep") or {}
    main = summary.get("main_draft")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    plotted = 0
    for set_name, by_draft in results.items():
        for draft, r in by_draft.items():
            curve = r.get("acceptance_length_vs_k") or {}
            ks = sorted(int(x) for x in curve)
            line, = ax.plot(ks, [curve[str(x)] for x in ks], marker=".",
                            label=f"{set_name} / {draft} (replay)" if ks else None)
            plotted += 1
            by_draft = (summary.get("vllm_k_sweep_by_draft") or {}).get(set_name) or {}
            swept = by_draft.get(draft, (sweep.get(set_name) or {}) if draft == main else {})
            served = {int(x): v["acceptance_length"] for x, v in swept.items()}
            served.setdefault(summary["settings"]["num_speculative_tokens"], r["vllm"]["acceptance_length"])
            ax.scatter(list(served), list(served.values()), color=line.get_color(), marker="s",
                       zorder=3, label=f"{set_name} / {draft} (vLLM)")
    if not plotted:
        _no_data(ax, "acceptance")
        return _save(fig, path)
    ax.set(title="acceptance length vs speculative tokens", xlabel="num_speculative_tokens (K)",
           ylabel="acceptance length")
    ax.grid(alpha=0.3)
    speedups = [(set_name, {int(x): v["speedup"] for x, v in by_k.items() if v.get("speedup")})
                for set_name, by_k in sweep.items()]
    if any(s for _, s in speedups):
        right = ax.twinx()
        for set_name, s in speedups:
            ks = sorted(s)
            right.plot(ks, [s[x] for x in ks], linestyle="--", marker="^",
                       label=f"{set_name} speedup (vLLM)")
        right.set_ylabel("speedup (output tokens/s ratio)")
        right.legend(fontsize=8, loc="lower right")
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, path)


def plot_vocab_coverage(vocab_stats: dict, path) -> Path:
    """Share of assistant tokens the draft vocabulary covers, against its size."""
    curve = vocab_stats.get("coverage_at_size") or {}
    fig, ax = plt.subplots(figsize=(7, 4))
    if not curve:
        _no_data(ax, "vocab coverage")
        return _save(fig, path)
    sizes = sorted(int(x) for x in curve)
    ax.plot(sizes, [curve[str(x)] for x in sizes], marker="o")
    chosen = vocab_stats.get("draft_vocab_size")
    if chosen:
        ax.axvline(chosen, color="gray", linestyle="--")
        ax.annotate(f"draft vocab {chosen:,}: {vocab_stats.get('coverage', 0):.1%}",
                    (chosen, vocab_stats.get("coverage", 0)), textcoords="offset points",
                    xytext=(6, -14), fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set(title="vocab coverage of assistant tokens", xlabel="draft vocab size",
           ylabel="coverage", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_throughput(extraction: dict[str, list[dict]], metrics: list[dict], path) -> Path:
    """Extraction tokens/s per shard over wall-clock time (per split), and training
    tokens/s per logged step."""
    fig, (ext_ax, train_ax) = plt.subplots(1, 2, figsize=(11, 4))
    rows = [r for split_rows in extraction.values() for r in split_rows]
    if rows:
        t0 = min(r["finished_at"] - r["compute_s"] for r in rows)
        for split, split_rows in extraction.items():
            split_rows = sorted(split_rows, key=lambda r: r["finished_at"])
            ext_ax.plot([(r["finished_at"] - t0) / 60 for r in split_rows],
                        [r["num_tokens"] / r["compute_s"] if r["compute_s"] > 0 else 0
                         for r in split_rows], marker="o", label=split)
        ext_ax.set(title="extraction throughput (per shard)", xlabel="minutes since first shard",
                   ylabel="tokens/s")
        ext_ax.grid(alpha=0.3)
        ext_ax.legend(fontsize=8)
    else:
        _no_data(ext_ax, "extraction timing")
    if metrics:
        train_ax.plot([m["step"] for m in metrics], [m["tokens_per_s"] for m in metrics],
                      marker=".", color="tab:green")
        train_ax.set(title="training throughput", xlabel="optimizer step", ylabel="tokens/s")
        train_ax.grid(alpha=0.3)
    else:
        _no_data(train_ax, "training metrics")
    return _save(fig, path)
