"""Runs benchmarks/speculative.py, whose docstring says what it does and how (from any cwd)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.speculative import main  # noqa: E402

if __name__ == "__main__":
    main()
