"""Benchmarks of Tandem beside its peers (`python -m bench.peers`); see __main__.py."""
