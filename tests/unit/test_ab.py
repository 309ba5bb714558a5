"""benchmarks/ab.py (scripts/ab.py): interleaved runs of a command per arm, the figures parsed
and summarised."""
import os
import sys

import pytest

from benchmarks import ab

PRINT_V = [sys.executable, "-c", "import os; print('x', os.environ.get('AB_V', '2.0'), 'ms/token')"]


def table_rows(out: str) -> dict[str, str]:
    """The summary's rows by arm name."""
    return {r.split("|")[1].strip(): r for r in out.splitlines() if r.startswith("| ")}


def test_env_arms_interleaved_and_summarised(capsys):
    ab.main(["--runs", "3", "--arm", "base=", "--arm", "hi=AB_V=3.0 OTHER=1", "--"] + PRINT_V)
    out = capsys.readouterr().out
    rounds = [line.split()[2] for line in out.splitlines() if line.startswith("  round")]
    assert rounds == ["base", "hi", "hi", "base", "base", "hi"]   # each round starts one later
    rows = table_rows(out)
    assert "| 3 | 2 | 0 | 2 | 2 |" in rows["base"]
    assert "| 3 | 3 | 0 | 3 | 3 | +1 (+50.0 %) | 0 |" in rows["hi"]


def test_a_run_without_the_figure_counts_as_failed(capsys):
    silent = [sys.executable, "-c", "import os, sys; sys.exit(int(os.environ.get('AB_FAIL', 0)))"]
    ab.main(["--runs", "2", "--pattern", r"(\d+) ms/token", "--arm", "a=", "--arm",
             "b=AB_FAIL=3", "--"] + silent)
    out = capsys.readouterr().out
    assert "a: failed (exit 0)" in out and "b: failed (exit 3)" in out
    assert "| a | 0 (2 failed) |" in out and "| b | 0 (2 failed) |" in out


def test_rev_arm_runs_in_an_export_of_that_revision(capsys):
    here = [sys.executable, "-c", "import os, pathlib; print(int("
            "pathlib.Path('conveyor/__init__.py').exists() and 'conveyor-ab-' in os.getcwd()"
            " and os.environ['PYTHONPATH'].startswith(os.getcwd())), 'ms/token')"]
    ab.main(["--runs", "1", "--arm", "head@HEAD", "--arm", "tree=", "--"] + here)
    rows = table_rows(capsys.readouterr().out)
    assert "| 1 | 1 |" in rows["head"]       # ran in the export, its tree first on PYTHONPATH
    assert "| 1 | 0 |" in rows["tree"]       # ran in this checkout


def test_a_pattern_without_a_group_is_refused():
    with pytest.raises(SystemExit, match="group"):
        ab.main(["--pattern", "ms/token", "--arm", "a=", "--arm", "b=", "--", "true"])


@pytest.mark.parametrize("spec", ["nothing", "a=B", "a=B=1 C"])
def test_an_arm_that_is_neither_env_nor_rev_is_refused(spec):
    with pytest.raises(SystemExit, match="--arm"):
        ab.main(["--arm", spec, "--arm", "x=", "--", "true"])


def test_rev_arm_may_name_a_folder_holding_an_export(tmp_path, capsys):
    tree = tmp_path / "conveyor-ab-old"
    (tree / "conveyor").mkdir(parents=True)
    (tree / "conveyor" / "__init__.py").write_text("")
    here = [sys.executable, "-c", "import os; print(int(os.getcwd().endswith('conveyor-ab-old')"
            " and os.environ['PYTHONPATH'].startswith(os.getcwd())), 'ms/token')"]
    ab.main(["--runs", "1", "--arm", f"old@{tree}", "--arm", "tree=", "--"] + here)
    rows = table_rows(capsys.readouterr().out)
    assert "| 1 | 1 |" in rows["old"] and "| 1 | 0 |" in rows["tree"]


def test_a_relative_program_is_found_from_every_arms_folder(tmp_path, capsys):
    tree = tmp_path / "old"
    tree.mkdir()
    python = os.path.relpath(sys.executable)
    assert os.sep in python
    ab.main(["--runs", "1", "--arm", f"old@{tree}", "--arm", "here=", "--", python, "-c",
             "print(7, 'ms/token')"])
    out = capsys.readouterr().out
    assert "| old | 1 | 7 |" in out and "| here | 1 | 7 |" in out
