"""Benchmarks of pympar (run as scripts under mpiexec)."""
