"""Runs benchmarks/fleet/cli.py, whose docstring says what it does and how (from any cwd)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.fleet.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
