"""Runs benchmarks/moe_tiles.py, whose docstring says what it does and how (any cwd)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.moe_tiles import main  # noqa: E402

if __name__ == "__main__":
    main()
