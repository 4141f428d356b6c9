"""The benchmarks behind ``python -m delta_sync.bench {apply,e2e,skeleton,sync}`` (entry points of
the ``delta_sync.bench`` group): each prints ratios measured in one run (docs/benchmarks.md)."""
