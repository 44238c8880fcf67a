"""Parallelism applied from outside the model: the rank layout and process groups, tensor, sequence, context and
pipeline parallelism, the tied embedding, gradient clipping and DeepSpeed ZeRO."""
