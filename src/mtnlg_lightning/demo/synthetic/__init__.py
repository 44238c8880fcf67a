"""Corpora made on purpose, with their truth: the demo corpus (the standard library's docstrings), the near-duplicate
corpus (`mtnlg-make-near-dup-corpus`), the synthetic web crawl (WARC), the cloze set, and the pipeline's planted
corpus and crawl (`mtnlg-pipeline`; `.smoke()` is the reduced run of `--smoke`)."""
