"""The speculative and structured-output benchmarks at a tiny size on the CPU, with the default
model: every pass runs and the closing summary has each figure (first round and rounds' ratios)."""
import re
import sys

import pytest


@pytest.mark.slow
def test_speculative_throughput_alternates_engines(monkeypatch, capsys):
    from benchmarks import speculative

    monkeypatch.setattr(sys, "argv", ["bench", "throughput", "--device", "cpu", "--batches", "1",
                                      "2", "--max-tokens", "8", "--rounds", "2"])
    speculative.main()
    out = capsys.readouterr().out
    passes = re.findall(r"'mode': '(\w+)', 'batch': (\d+).*'round': (\d)", out)
    assert sorted(passes) == sorted((m, b, r) for m in ("baseline", "ngram")
                                    for b in ("1", "2") for r in ("0", "1"))
    rows = re.findall(r"^\s+(\d+)\s+ngram k=4\s+[\d,]+\s+[\d,]+\s+[\d.]+x\s+([\d.]+x, [\d.]+x)$",
                      out, re.M)
    assert [b for b, _ in rows] == ["1", "2"]


@pytest.mark.slow
def test_speculative_replay_counts_plans_under_both_policies(monkeypatch, capsys):
    """The replay drives the real scheduler: n-gram lookups overlap the next plan, every
    token comes from some plan, and backing off (the scheduler's own rule) verifies no more
    than verifying every guess does and leaves the policy's limit as it was."""
    from benchmarks import speculative
    from conveyor.scheduler import speculation

    monkeypatch.setattr(sys, "argv", ["bench", "replay", "--device", "cpu", "--batch", "2",
                                      "--k", "4", "--max-tokens", "24"])
    speculative.main()
    rows = re.findall(r"^\s+4\s+(always|back-off)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)$",
                      capsys.readouterr().out, re.M)
    assert [r[0] for r in rows] == ["always", "back-off"]
    for _, plans, verify, overlapped, per_plan in rows:
        assert 0 < int(verify) < int(plans) and 0 < int(overlapped) < int(plans)
        assert float(per_plan) * int(plans) == pytest.approx(48, abs=0.05 * int(plans))
    assert int(rows[1][2]) <= int(rows[0][2]) and speculation.MAX_SPEC_WAIT == 8


@pytest.mark.slow
def test_structured_outputs_reports_first_round_and_median(monkeypatch, capsys):
    from benchmarks import structured_outputs

    monkeypatch.setattr(sys, "argv", ["bench", "--device", "cpu", "--batch", "2",
                                      "--max-tokens", "4", "--trials", "1", "--rounds", "2"])
    structured_outputs.main()
    out = capsys.readouterr().out
    for kind in ("json schema", "json, bounded strings"):
        assert re.search(rf"decode, {kind}\s+[\d.]+ tok/s\s+[\d.]+x.*median of 2 rounds "
                         rf"[\d.]+x", out), out
    assert re.search(r"first token, cached schema\s+[\d.]+ ms", out)
    # the engine's own counters: every constrained kind's steps took a bitmask
    assert re.search(r"bitmask a constrained step.*: json schema [\d.]+ / [\d.]+ ms; "
                     r"json, bounded strings [\d.]+ / [\d.]+ ms$", out, re.M), out


@pytest.mark.slow
def test_mask_fill_host_runs_every_mode(monkeypatch, capsys):
    """Each mode's row (the process mode's child included) with a step time, and every mode
    but none with a fill time."""
    from benchmarks import mask_fill_host

    monkeypatch.setattr(sys, "argv", ["bench", "--rows", "3", "--steps", "6", "--skip", "2",
                                      "--work-ms", "0.2"])
    mask_fill_host.main()
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+auto\s+(\w+)\s+([\d.]+)\s+(\S*)\s+([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["none", "serial", "thread", "process"], out
    assert all(float(step) > 0.2 for _, step, _, _ in rows)
    assert [float(fill) > 0 for *_, fill in rows] == [False, True, True, True]
