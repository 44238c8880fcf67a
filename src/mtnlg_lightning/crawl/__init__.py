"""From Common Crawl to training text: WARC/WET extraction with language identification (`mtnlg-extract`), and
heuristic quality rules plus a GPT-3 style quality classifier (`mtnlg-quality`).

The third-party packages (warcio, jusText, pyCLD2, scikit-learn) come with the `crawl` extra and are imported
only inside the functions that use them, so `--help` and the one-line "install the extra" message need none.
"""
