"""Inference in any parallel layout: a checkpoint read slice by slice into this rank's TP shard of its pipeline
stage(s), scored and decoded through the stages (`mtnlg-eval --strategy`, `mtnlg-generate --strategy`,
`DownstreamEval` under the 3D strategy)."""
