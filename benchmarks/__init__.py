"""The benchmarks, stress tests and their tools; scripts/ holds a thin entry point for each.

Not installed with conveyor (setup.cfg packages only `conveyor`): scripts/*.py put the repository
root on sys.path, and pytest does (setup.cfg `pythonpath`). Importing this package imports
nothing: benchmarks/scheduler.py times the torch-free scheduler and must not pull in torch.
"""
