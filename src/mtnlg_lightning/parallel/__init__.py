"""Parallelism applied from outside the model: layout, tensor parallelism, ZeRO (and pipelining, part 2)."""
