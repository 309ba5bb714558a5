"""The parts of benchmarks/stress.py (run as scripts/stress.py): harness (the server, reports,
engine state), clients, scenarios (load and faults) and fuzz (bad input)."""
