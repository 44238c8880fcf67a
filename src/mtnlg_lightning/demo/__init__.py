"""The demo part of the house: what shows the trainer at work rather than what trains. The offline demo corpus
(`builtin_corpus`, registered as `data.builtin_corpus: python-docs` through an entry point), the corpora made on
purpose with their truth (`synthetic/`), the end-to-end experiment (`pipeline/`, `mtnlg-pipeline`) and the demo's
cloze set (`mtnlg-make-cloze-set`). It stands on the trainer's public modules; nothing outside it imports it."""
