"""headwise benchmarks: each op against its eager reference (headwise.reference) and
torch.compile of that reference, in one process, reporting medians of repeated runs.
Run ``python -m headwise.bench [op ...]``."""
