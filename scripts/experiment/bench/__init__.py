"""Benchmark-only parts of the experiment package (the churn driver and its figures, the
emulated accelerator), used by scripts/bench_churn.py and the tests; not in the wheel."""
