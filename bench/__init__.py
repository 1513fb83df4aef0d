"""Benchmarks of k2b_workflows on a real PostgreSQL: ``make bench`` runs ``bench/run.py``."""
