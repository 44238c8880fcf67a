"""Corpora made on purpose, with their truth: the demo corpus (the standard library's docstrings), the near-duplicate
corpus (`tools/make_near_dup_corpus.py`), the synthetic web crawl (WARC), the cloze set, and the pipeline's planted
corpus and crawl (`tools/pipeline.py`; `.smoke()` is the reduced run of `--smoke`)."""
