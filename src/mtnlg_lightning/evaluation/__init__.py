"""Evaluation as in the MT-NLG paper: LAMBADA (zero/one/few-shot), HANS with in-context examples, perplexity, an
lm-evaluation-harness adapter, the paper's task table (`suite`, `--suite mtnlg`) and its social-bias study (`bias`);
`mtnlg-eval` on the command line, `DownstreamEval` during training."""
