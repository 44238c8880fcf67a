"""The bias study in one figure (`mtnlg-eval --plot PATH`, the `[plot]` extra): a panel per task's view, for the
tasks that ran: the most skewed occupations (gender-occupation), the most favoured words of each group per category
(cooccurrence), and the mean sentiment per group with its 95% interval (sentiment)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mtnlg_lightning.outputs import atomic_path

FAVOURED_SHOWN = 4  # words per group in a cooccurrence panel
SKEWED_SHOWN = 8  # occupations each way


def panels(results: dict) -> list[tuple[str, Callable]]:
    out = []
    if "gender-occupation" in results:
        out.append(("gender-occupation", lambda ax: draw_gender_occupation(ax, results["gender-occupation"])))
    for category, groups in results.get("cooccurrence", {}).get("groups", {}).items():
        out.append((category, lambda ax, c=category, g=groups: draw_cooccurrence(ax, c, g)))
    if "sentiment" in results:
        out.append(("sentiment", lambda ax: draw_sentiment(ax, results["sentiment"]["categories"])))
    return out


def draw_gender_occupation(ax, result: dict) -> None:
    s = result["summary"]
    shown = s["most_male"][:SKEWED_SHOWN][::-1] + s["most_female"][:SKEWED_SHOWN][::-1]
    names, ratios = [o for o, _ in shown], [r for _, r in shown]
    ax.barh(range(len(shown)), ratios, color=["tab:blue" if r < 0 else "tab:red" for r in ratios])
    ax.set_yticks(range(len(shown)), names, fontsize=7)
    ax.axvline(0, color="black", linewidth=0.6)
    ax.set_xlabel("log P(female) - log P(male)", fontsize=8)
    ax.set_title(
        f"gender-occupation: {s['share_leaning_male']:.0%} of {s['occupations']} lean male\n"
        f"mean log-ratio {s['mean_log_ratio']:+.3f}",
        fontsize=9,
    )


def draw_cooccurrence(ax, category: str, groups: dict) -> None:
    labels, counts, colors = [], [], []
    palette = ["tab:blue", "tab:red", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:gray", "tab:olive"]
    for k, (group, g) in enumerate(groups.items()):
        for word, count, _ in g["most_favoured"][:FAVOURED_SHOWN]:
            labels.append(f"{group}: {word}")
            counts.append(count)
            colors.append(palette[k % len(palette)])
    ax.barh(range(len(labels)), counts, color=colors)
    ax.set_yticks(range(len(labels)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("count in the group's continuations", fontsize=8)
    ax.set_title(f"cooccurrence ({category}): most favoured words", fontsize=9)


def draw_sentiment(ax, categories: dict) -> None:
    labels, means, errors, colors, x = [], [], [], [], []
    position = 0
    for k, c in enumerate(categories.values()):
        for group, g in c["groups"].items():
            labels.append(group)
            means.append(g["mean"])
            errors.append(1.96 * g["sem"])
            colors.append(["tab:blue", "tab:orange", "tab:green"][k % 3])
            x.append(position)
            position += 1
        position += 1  # a gap between categories
    ax.bar(x, means, yerr=errors, color=colors, capsize=2)
    ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_ylabel("mean VADER compound (95% interval)", fontsize=8)
    ax.set_title("sentiment of continuations: " + ", ".join(categories), fontsize=9)


def plot_study(results: dict, path: str | Path) -> str:
    """Draw the panels of `results` into one PNG at `path` (written whole, then renamed into place)."""
    import matplotlib  # optional extra [plot]: imported on use

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = panels(results)
    columns = min(3, len(drawn))
    rows = -(-len(drawn) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 4.2 * rows), squeeze=False)
    for ax, (_, draw) in zip(axes.flat, drawn, strict=False):
        draw(ax)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(drawn) :]:
        ax.set_visible(False)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
    return str(path)
