"""A step's time from its shape, fitted from measured steps (no torch: numpy only).

A step's shape (`StepShape`): tokens T it computes, sequences S it samples (one logits row
each), KV tokens K its decodes read (the sum of their contexts) and query-key pairs A its
prefill chunks attend (a chunk of n tokens after s computed ones: n*s + n(n+1)/2). Its time:

    t = base(T) + c_seq * S + c_kv * K + c_attn * A

base(T) is piecewise linear through knots (T_i, t_i), flat below the first knot and extended
along the last segment past the last one, so it follows a GPU's flat launch- or weight-bound
floor and its compute-bound slope alike, and a CPU's straight line. `fit` finds the knots' times
and the three coefficients by non-negative least squares from measured steps.

Parallel layouts scale a replica's step (`parallel_step`): tensor parallel divides the work
by tp at an efficiency and adds 2 all-reduces a layer of T x hidden activations; pipeline
parallel gives each of pp stages 1/pp of it plus a hop sending T x hidden activations on.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

COSTS_DIR = Path(__file__).resolve().parent / "costs"


@dataclass(frozen=True, slots=True)
class StepShape:
    tokens: int                              # T: tokens computed
    seqs: int                                # S: sequences sampled
    kv: int                                  # K: KV tokens read by decodes
    attn: float                              # A: query-key pairs of prefill chunks


def part_features(start: int, num: int) -> tuple[int, float]:
    """(K, A) of one sequence's part of a step: num tokens after `start` computed ones. A single
    token after a context is a decode (reads the context); longer parts are prefill chunks."""
    if num == 1 and start > 0:
        return start + 1, 0.0
    return 0, num * start + num * (num + 1) / 2


@dataclass(frozen=True)
class Parallel:
    """What tensor and pipeline parallel cost on the hardware of a cost file."""
    tp_efficiency: float = 0.85              # the share of a tp-fold speed-up the work gets
    allreduce_latency_s: float = 20e-6       # one all-reduce's fixed cost
    allreduce_bytes_per_s: float = 150e9     # its bus bandwidth over the activations' bytes
    pp_hop_latency_s: float = 30e-6          # one stage handing activations to the next
    pp_hop_bytes_per_s: float = 40e9         # ... its bandwidth (InfiniBand between nodes)
    fixed_s: float = 0.0                     # host time a step that no parallelism divides


@dataclass(frozen=True)
class Model:
    """Sizes of the model that TP, PP and the KV pool depend on."""
    layers: int = 0
    hidden: int = 0
    activation_bytes: int = 2                # bytes of one activation element
    weights_bytes: float = 0.0
    kv_bytes_per_token: float = 0.0


@dataclass(frozen=True)
class CostModel:
    name: str
    knots: list[tuple[float, float]]         # (tokens, seconds) of base(T), tokens ascending
    c_seq: float = 0.0
    c_kv: float = 0.0
    c_attn: float = 0.0
    # settings of the engine whose steps these are (the simulator's defaults)
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    async_scheduling: bool = True
    num_blocks: int | None = None            # KV pool of one replica (None: from memory below)
    gpu_memory_bytes: float = 0.0            # per GPU, times gpu_memory_utilization
    reserve_bytes: float = 0.0               # per GPU: activations, graphs, the runtime
    request_overhead_s: float = 0.0          # client and frontend time added to each TTFT
    model: Model = field(default_factory=Model)
    parallel: Parallel = field(default_factory=Parallel)
    source: str = ""                         # where the figures come from

    def step_time(self, s: StepShape) -> float:
        return (self.base(s.tokens) + self.c_seq * s.seqs + self.c_kv * s.kv
                + self.c_attn * s.attn)

    def base(self, tokens: float) -> float:
        xs = [k[0] for k in self.knots]
        ys = [k[1] for k in self.knots]
        if len(xs) == 1 or tokens <= xs[0]:
            return ys[0]
        if tokens >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (tokens - xs[-1])
        return float(np.interp(tokens, xs, ys))

    def parallel_step(self, s: StepShape, tp: int = 1, pp: int = 1) -> tuple[float, float]:
        """(the time one stage holds a step, the step's time through every stage) on a replica
        of tp x pp GPUs."""
        p, m = self.parallel, self.model
        work = max(0.0, self.step_time(s) - p.fixed_s)
        if tp > 1:
            work /= tp * p.tp_efficiency
            act = s.tokens * m.hidden * m.activation_bytes
            # NOTE: a ring all-reduce moves 2 (tp-1)/tp of the tensor through each GPU's link
            per = p.allreduce_latency_s + 2 * (tp - 1) / tp * act / p.allreduce_bytes_per_s
            work += 2 * m.layers * per
        if pp == 1:
            t = work + p.fixed_s
            return t, t
        hop = p.pp_hop_latency_s + s.tokens * m.hidden * m.activation_bytes / p.pp_hop_bytes_per_s
        stage = work / pp + hop
        return stage, stage * pp + p.fixed_s

    def replica_blocks(self, tp: int = 1, pp: int = 1) -> int:
        """KV blocks of one replica: the given pool, or the memory of its tp*pp GPUs less the
        weights (once, split over them) and each GPU's reserve."""
        if self.num_blocks is not None:
            return self.num_blocks
        m = self.model
        free = tp * pp * (self.gpu_memory_bytes - self.reserve_bytes) - m.weights_bytes
        if free <= 0 or m.kv_bytes_per_token <= 0:
            raise ValueError(f"{self.name}: no memory left for the KV cache at tp={tp} pp={pp}")
        return int(free / (m.kv_bytes_per_token * self.block_size))

    # --- files ----------------------------------------------------------------------------

    def to_json(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, doc: dict) -> CostModel:
        doc = dict(doc)
        doc.pop("samples", None)             # a measuring run's raw steps ride along
        doc["knots"] = [tuple(k) for k in doc["knots"]]
        doc["model"] = Model(**doc.get("model", {}))
        doc["parallel"] = Parallel(**doc.get("parallel", {}))
        return cls(**doc)

    @classmethod
    def load(cls, name_or_path: str | Path) -> CostModel:
        """A cost file by path, or by name from benchmarks/fleet/costs/ (e.g. h200-llama3.1-8b)."""
        path = Path(name_or_path)
        if not path.is_file():
            path = COSTS_DIR / f"{name_or_path}.json"
        if not path.is_file():
            known = sorted(p.stem for p in COSTS_DIR.glob("*.json"))
            raise FileNotFoundError(f"no cost file {name_or_path!r} (built in: {known})")
        return cls.from_json(json.loads(path.read_text()))


def fit(samples: list[tuple[StepShape, float]], knots: list[float] | None = None,
        trim: float = 3.0) -> tuple[list[tuple[float, float]], float, float, float]:
    """(knots, c_seq, c_kv, c_attn) fitted to measured (shape, seconds) steps by non-negative
    least squares on relative error (short and long steps weigh alike). base(T) is fitted as
    its value at the first knot plus a non-negative slope a segment, so it never falls as
    steps grow. Knots default to 1, 4, 16, ... (x4) below the largest step measured, and
    that step's tokens: fewer unknowns than shapes, so the fit smooths noise instead of
    following it. Steps off the first fit by more than `trim` times the median relative error
    (a shared machine's hiccups) are dropped and the rest fitted again."""
    if not samples:
        raise ValueError("no measured steps to fit")
    if knots is None:
        top = max(s.tokens for s, _ in samples)
        knots = [4 ** i for i in range(12) if 4 ** i < top] + [top]
    xs = sorted(set(knots))

    def row(s: StepShape) -> list[float]:
        ramps = [min(max(s.tokens - a, 0), b - a) for a, b in zip(xs[:-2], xs[1:-1])]
        if len(xs) > 1:                      # the last segment goes on past its knot
            ramps.append(max(s.tokens - xs[-2], 0))
        return [1.0, *ramps, s.seqs, s.kv, s.attn]

    def solve(kept):
        a = np.array([row(s) for s, _ in kept]) / np.array([[t] for _, t in kept])
        return nnls(a, np.ones(len(kept)))

    coef = solve(samples)
    errors = [abs(float(np.dot(row(s), coef)) / t - 1) for s, t in samples]
    cut = trim * float(np.median(errors))
    kept = [st for st, e in zip(samples, errors) if e <= cut]
    if cut > 0 and len(kept) >= len(coef) and len(kept) < len(samples):
        coef = solve(kept)
    ys = [float(coef[0])]
    for j in range(len(xs) - 1):
        ys.append(ys[-1] + float(coef[1 + j]) * (xs[j + 1] - xs[j]))
    n = len(xs)
    return ([(float(x), y) for x, y in zip(xs, ys)],
            float(coef[n]), float(coef[n + 1]), float(coef[n + 2]))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| with x >= 0: least squares over a shrinking set of free columns, dropping
    the most negative until none is (columns are scaled first, so the features' units do not
    matter)."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0.0
            x[free] = sol
            break
        del free[int(np.argmin(sol))]
    return x / scale


def relative_errors(model: CostModel, samples: list[tuple[StepShape, float]]) -> list[float]:
    return [model.step_time(s) / t - 1 for s, t in samples]


def describe(model: CostModel) -> str:
    knots = ", ".join(f"{x:g}: {y * 1e3:.2f}" for x, y in model.knots)
    return (f"{model.name}: base(T) ms at T = {knots}; per sampled sequence "
            f"{model.c_seq * 1e6:.1f} us, per KV token read {model.c_kv * 1e9:.2f} ns, per "
            f"prefill attention pair {model.c_attn * 1e12:.3f} ps")
