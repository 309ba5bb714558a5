"""benchmarks/gpu_idle.py's attribution of a step's GPU time to kernels."""
from benchmarks.gpu_idle import critical_times


def test_critical_times_charge_only_what_extends_the_busy_time():
    spans = [("gemv", 0.0, 10.0),
             ("norm", 4.0, 12.0),     # launched early (PDL), ends 2 after the GEMV
             ("gemv", 11.0, 11.5),    # inside the norm's span: adds nothing
             ("sample", 20.0, 25.0),  # after an idle gap, which nobody is charged
             ("norm", 24.0, 30.0)]
    added = critical_times(list(reversed(spans)))     # any order in: sorted by start
    assert added == {"gemv": 10.0, "norm": 7.0, "sample": 5.0}
    assert sum(added.values()) == 22.0                # the union of the spans


def test_no_spans_no_time():
    assert critical_times([]) == {}
