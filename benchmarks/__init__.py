"""CPU benchmark suite: `python -m benchmarks` (see benchmarks/__main__.py and benchmarks/suite.py)."""
