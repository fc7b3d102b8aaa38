"""Reproducible benchmarks of iop; each module runs with `python -m bench.<name>`."""
