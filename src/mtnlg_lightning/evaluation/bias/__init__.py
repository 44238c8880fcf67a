"""The social-bias study of MT-NLG Section 6 (after GPT-3 Section 6.2), on a model without anti-bias
countermeasures: gender and occupation (`gender_occupation`), descriptive words by gender, ethnicity and religion
(`cooccurrence`), sentiment of continuations by ethnicity and religion (`sentiment`). Tasks of `mtnlg-eval`
(`study`); word lists and prompts in `study.json` (`wordlists`)."""
