"""Evaluation as in the MT-NLG paper: LAMBADA (zero/one/few-shot), HANS with in-context examples, perplexity, and an
lm-evaluation-harness adapter; `mtnlg-eval` on the command line, `DownstreamEval` during training."""
