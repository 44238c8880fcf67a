"""The bias study's results as markdown tables (printed at the end of `mtnlg-eval`, ready to paste into a report).
Numbers are rounded to 3 decimals: the same in every layout."""

from __future__ import annotations

SHOWN_WORDS = 6  # words per group in the cooccurrence table (results.json holds 10)


def gender_occupation_table(result: dict) -> str:
    s = result["summary"]
    lines = [
        f"gender-occupation: {s['occupations']} occupations; leaning male {s['share_leaning_male']:.3f}, leaning "
        f"female {s['share_leaning_female']:.3f}; mean log-ratio log P(female) - log P(male) {s['mean_log_ratio']:.3f}",
        "",
        "| template | mean log-ratio | leaning male |",
        "|---|---:|---:|",
    ]
    lines += [f"| {t} | {v['mean_log_ratio']:.3f} | {v['share_leaning_male']:.3f} |" for t, v in s["templates"].items()]
    for way in ("male", "female"):
        shown = ", ".join(f"{o} {r:+.3f}" for o, r in s[f"most_{way}"]) or "-"
        lines.append(f"\nmost {way}: {shown}")
    return "\n".join(lines)


def cooccurrence_table(result: dict) -> str:
    settings = result["sampling"]
    lines = [
        f"cooccurrence: {settings['continuations']} continuations of up to {settings['max_new_tokens']} tokens per "
        f"prompt (temperature {settings['temperature']}, top-p {settings['top_p']}, top-k {settings['top_k']}, seed "
        f"{settings['seed']}); adjectives and adverbs, the most favoured against the category's other groups (count)",
        "",
        "| category | group | continuations | descriptive words | most favoured (count) | most frequent (count) |",
        "|---|---|---:|---:|---|---|",
    ]
    for category, groups in result["groups"].items():
        for group, g in groups.items():
            favoured = ", ".join(f"{w} ({c})" for w, c, _ in g["most_favoured"][:SHOWN_WORDS]) or "-"
            frequent = ", ".join(f"{w} ({c})" for w, c in g["most_frequent"][:SHOWN_WORDS]) or "-"
            lines.append(
                f"| {category} | {group} | {g['continuations']} | {g['descriptive_words']} | {favoured} | {frequent} |"
            )
    return "\n".join(lines)


def sentiment_table(result: dict) -> str:
    lines = [
        "sentiment: VADER compound score of each continuation (-1 negative .. +1 positive)",
        "",
        "| category | group | continuations | mean | std | vs category | positive | negative |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for category, c in result["categories"].items():
        for group, g in c["groups"].items():
            lines.append(
                f"| {category} | {group} | {g['continuations']} | {g['mean']:.3f} | {g['std']:.3f} | "
                f"{g['vs_category']:+.3f} | {g['share_positive']:.3f} | {g['share_negative']:.3f} |"
            )
        lines.append(f"| {category} | (all) | | {c['mean']:.3f} | | | | |")
    return "\n".join(lines)


TABLES = {
    "gender-occupation": gender_occupation_table,
    "cooccurrence": cooccurrence_table,
    "sentiment": sentiment_table,
}


def study_table(results: dict) -> str:
    return "\n\n".join(TABLES[task](result) for task, result in results.items())
