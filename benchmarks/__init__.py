"""Benchmarks, run by hand from the repository root (benchmarks/README.md). A package so that tests import
their reusable parts as ``benchmarks.<name>`` (pytest puts the repository root on sys.path, pyproject.toml)."""
