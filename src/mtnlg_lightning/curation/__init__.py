"""MT-NLG data curation: fuzzy deduplication (MinHash LSH, exact-Jaccard verified) and downstream-task
decontamination (Megatron-LM filter_ngrams semantics). CLIs: ``mtnlg-dedup``, ``mtnlg-decontaminate``.

Submodules: ``shingles`` (normalisation, vectorised shingle hashing), ``minhash`` (datasketch-exact MinHash),
``lsh`` (bands x rows), ``signatures`` / ``verify`` / ``dedup`` (restartable stages), ``decontaminate``,
(records and atomic output: ``mtnlg_lightning.corpora``). The labelled corpora the tools are measured on are in
``mtnlg_lightning.demo.synthetic`` (``mtnlg-make-near-dup-corpus``, docs/curation.md).
"""
