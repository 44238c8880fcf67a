"""MT-NLG data curation: fuzzy deduplication (MinHash LSH, exact-Jaccard verified) and downstream-task
decontamination (Megatron-LM filter_ngrams semantics). CLIs: ``mtnlg-dedup``, ``mtnlg-decontaminate``.

Submodules: ``shingles`` (normalisation, vectorised shingle hashing), ``minhash`` (datasketch-exact MinHash),
``lsh`` (bands x rows), ``signatures`` / ``verify`` / ``dedup`` (restartable stages), ``decontaminate``,
``jsonl`` (validated reading, atomic writing), ``synthetic`` (labelled corpora with their ground truth, to
measure the tools on: ``mtnlg-make-near-dup-corpus``, docs/curation.md; the benchmarks use it too).
"""
