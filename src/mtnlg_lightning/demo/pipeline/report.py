"""The pipeline's report: report.json (everything, machine-readable), report.md (for people), report.png (plot) and
bias.png (the bias study's figure, drawn by mtnlg-eval)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mtnlg_lightning.corpora.jsonl import atomic_write, write_json_atomic
from mtnlg_lightning.evaluation.bias.tables import study_table


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def write_report(out: Path, report: dict, plot: bool = True) -> None:
    if plot:
        report["plot"] = plot_experiment(out / "report.png", report["experiment"])
    write_json_atomic(str(out / "report.json"), report)
    with atomic_write(str(out / "report.md"), "w") as f:
        f.write(markdown(report))


def markdown(report: dict) -> str:
    lines = [f"# Pipeline report: `{report['out_dir']}`", ""]
    lines += [
        f"{'Reduced (smoke) run' if report['smoke'] else 'Full run'}, {report['seconds_total']:.0f} s in all. "
        f"Checks: **{sum(c['ok'] for c in report['checks'])}/{len(report['checks'])} passed**.",
        "",
        "## Stages",
        "",
        "| stage | docs in | docs out | bytes in | bytes out | tokens | seconds | command |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in report["stages"]:
        cells = [s["name"], _n(s["documents_in"]), _n(s["documents_out"]), _n(s["bytes_in"]), _n(s["bytes_out"])]
        cells += [_n(s["tokens"]), f"{s['seconds']:.1f}", f"`{s['command']}`"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += crawl_section(report.get("crawl_scores"))
    exp = report["experiment"]
    lines += [
        "",
        "## The contamination experiment",
        "",
        "Same model, seed and steps; A trained on the deduplicated corpus with the planted evaluation passages left",
        "in, B on the decontaminated corpus. LAMBADA-style scoring (lm-evaluation-harness `lambada_openai` rules):",
        "`acc` = the last word greedily right at every token; `perplexity` = exp(-mean target log-likelihood).",
        "",
        "| model | planted acc | planted perplexity | control acc | control perplexity | final train loss | "
        "docs with planted text |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run, label in (("contaminated", "A contaminated"), ("decontaminated", "B decontaminated")):
        r = exp[run]
        lines.append(
            f"| {label} | {r['planted']['acc']:.4f} | {r['planted']['perplexity']:.1f} | {r['control']['acc']:.4f} | "
            f"{r['control']['perplexity']:.1f} | {r['train']['final_loss']:.3f} | {r['documents_with_planted_text']} |"
        )
    gap = exp["planted_gap"]
    lines += [
        "",
        f"Planted-set gap: acc A - B = {gap['acc_contaminated_minus_decontaminated']:+.4f}; perplexity B / A = "
        f"{gap['perplexity_decontaminated_over_contaminated']:.2f}x. Control set: acc A - B = "
        f"{gap['control_acc_difference']:+.4f}, perplexity B / A = {gap['control_perplexity_ratio']:.2f}x.",
    ]
    if report.get("plot"):
        lines += ["", f"![loss curves and metrics]({Path(report['plot']).name})"]
    gen = report["generation"]
    lines += ["", "## Generation (B, exported to Hugging Face format)", "", "```", gen["text"], "```", ""]
    lines += bias_section(report.get("bias"), report.get("bias_plot"))
    lines += ["## Checks", ""]
    lines += [f"- {'PASS' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}" for c in report["checks"]]
    return "\n".join(lines) + "\n"


def bias_section(results: dict | None, plot: str | None) -> list[str]:
    """B's bias study (MT-NLG Section 6): the tables `mtnlg-eval` prints, and its figure."""
    if not results:
        return []

    lines = [
        "## The bias study (B; MT-NLG Section 6)",
        "",
        "`mtnlg-eval --task gender-occupation cooccurrence sentiment` on B with the shipped word lists and prompts",
        "(a model trained on Python's docstrings: the machinery at work, not a finding about the text).",
        "",
        study_table(results),
        "",
    ]
    if plot:
        lines += [f"![the bias study of B]({Path(plot).name})", ""]
    return lines


def crawl_section(scores: dict | None) -> list[str]:
    """Precision and recall of the crawl stages against the planted truth (absent without the crawl)."""
    if not scores:
        return []
    ex, lang, q = scores["extract"], scores["language"], scores["quality"]
    rows = [
        ("extract: documents", "planted pages (any language)", ex["documents"]),
        ("extract: words", "body words of the pages found", ex["body_words"]),
        ("language (en)", "planted English pages", lang["english_pages"]),
        ("quality: kept", "planted pages (not junk)", q["pages_kept"]),
        ("quality: dropped", "junk pages", q["junk_dropped"]),
    ]
    lines = [
        "",
        "## The crawl stages against the planted truth",
        "",
        "| stage | relevant | precision | recall |",
        "|---|---|---:|---:|",
    ]
    lines += [f"| {stage} | {what} | {r['precision']:.3f} | {r['recall']:.3f} |" for stage, what, r in rows]
    held = scores.get("quality_classifier_holdout")
    lines += [
        "",
        f"Boilerplate words left in the pages found: {ex['boilerplate_words_left']:.3f}. Language named right on "
        f"{lang['identification_accuracy']:.3f} of the planted pages extracted; junk pages past the language filter: "
        f"{lang['junk_passed']}."
        + (
            f" Quality classifier on its held-out documents: P/R {held['precision']:.3f}/{held['recall']:.3f}."
            if held
            else ""
        ),
    ]
    return lines


def _n(value) -> str:
    return "" if value is None else f"{value:,}"


def plot_experiment(path: Path, exp: dict) -> str | None:
    """Loss curves of A and B, and acc / perplexity on the planted and control sets, side by side."""
    try:
        import matplotlib  # optional extra [plot]: imported on use

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("pipeline: matplotlib is not installed (pip install 'mtnlg-lightning[plot]'): no plot written")
        return None
    runs = (("contaminated", "A: contaminated", "tab:red"), ("decontaminated", "B: decontaminated", "tab:blue"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"width_ratios": [1.6, 1, 1]})
    for run, label, color in runs:
        steps, losses = zip(*exp[run]["loss_curve"], strict=True)
        axes[0].plot(steps, losses, label=label, color=color, linewidth=1)
    axes[0].set(title="training loss", xlabel="step", ylabel="train_loss")
    axes[0].legend()
    width = 0.38
    for i, (metric, ax) in enumerate((("acc", axes[1]), ("perplexity", axes[2]))):
        for j, (run, label, color) in enumerate(runs):
            values = [exp[run][s][metric] for s in ("planted", "control")]
            bars = ax.bar([k + (j - 0.5) * width for k in range(2)], values, width, label=label, color=color)
            ax.bar_label(bars, fmt="%.3f" if metric == "acc" else "%.0f", fontsize=8)
        ax.set_xticks(range(2), ["planted", "control"])
        ax.set_title(["last-word accuracy (higher: better)", "target perplexity (lower: better)"][i])
        if metric == "perplexity":
            ax.set_yscale("log")
    fig.tight_layout()
    tmp = path.with_name("." + path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return str(path)
