"""Scripts and helpers of the multi-process tests (a regular package, so that no module named
`distributed` elsewhere on sys.path, such as benchmarks/distributed.py, can shadow it)."""
