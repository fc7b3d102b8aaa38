"""``iop qualify``: a standard, reproducible workload run through a running iop against each
provider of a model (docs/QUALIFY.md). ``workload`` measures, ``agreement`` compares answers,
``run`` drives a run and reports it."""
