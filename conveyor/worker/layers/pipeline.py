"""Pipeline-parallel helpers: this rank's stage, the layers it holds, and the activations it
takes from the stage before and hands to the stage after.

Without `set_stage` there is one stage holding every layer and nothing is sent, so every model
runs unchanged in a single process. A stage's layer list keeps every index (the layers of other
stages are empty placeholders), so module and checkpoint names stay `model.layers.<i>`.

Between stages go the hidden states and the residual stream of a step, [2, T, hidden] in the
model dtype, point to point over torch.distributed (gloo on CPU, NCCL on GPU) from rank
stage * TP + j to (stage + 1) * TP + j: each rank of a tensor-parallel group sends its own
(partial-sum) hidden states to its peer, which reduces them in its next norm as it would have.
T is known to the receiver from the StepPlan, so no shapes travel.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from conveyor.shared.parallel import layer_split


@dataclass(frozen=True)
class Stage:
    index: int = 0
    count: int = 1
    prev_rank: int = -1              # the peer of the stage before (-1: first stage)
    next_rank: int = -1              # the peer of the stage after (-1: last stage)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def layers(self, num_layers: int) -> range:
        """The decoder layers this stage runs (shared/parallel.py's split)."""
        return layer_split(num_layers, self.count)[self.index]


_stage = Stage()
_sends: deque = deque()              # sends in flight: (work, the tensor it reads)


def join_pipeline(rank: int, tp: int, pp: int) -> None:
    """After init_process_group over the PP x TP ranks: make this rank's stage its own and that
    stage's ranks its tensor-parallel group (every rank creates every group, in one order)."""
    from conveyor.shared.parallel import rank_place, stage_ranks
    from conveyor.worker.layers.parallel import set_tp_group

    groups = [dist.new_group(list(stage_ranks(s, tp))) for s in range(pp)]
    index, _ = rank_place(rank, tp)
    set_tp_group(groups[index])
    set_stage(Stage(index, pp, rank - tp if index > 0 else -1,
                    rank + tp if index < pp - 1 else -1))


def set_stage(stage: Stage) -> None:
    global _stage
    _stage = stage


def stage() -> Stage:
    return _stage


def make_layers(num_layers: int, build) -> tuple[nn.ModuleList, range]:
    """The decoder layers of this stage, build(i) for each i it holds and an empty placeholder
    for the others, and the range it holds."""
    held = _stage.layers(num_layers)
    return nn.ModuleList(build(i) if i in held else nn.Identity()
                         for i in range(num_layers)), held


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def stage_weight_name(name: str, num_layers: int, tied: bool) -> str | None:
    """A checkpoint tensor's name in this stage's model, or None if another stage holds it: a
    layer's on the stage that runs it, the embedding on the first stage, the final norm and
    the LM head on the last (which, with tied embeddings, loads the embedding as its head)."""
    s = _stage
    if s.count == 1:
        return name
    if m := _LAYER.match(name):
        return name if int(m.group(1)) in s.layers(num_layers) else None
    if name.startswith("model.embed_tokens."):
        if s.first:
            return name
        return name.replace("model.embed_tokens.", "lm_head.") if s.last and tied else None
    if name.startswith(("model.norm.", "lm_head.")):
        return name if s.last else None
    return name


def send_activations(hidden: torch.Tensor, residual: torch.Tensor) -> None:
    """Hand this stage's output to the next stage without waiting for it to be taken (the
    previous send is waited for first, so at most one is in flight)."""
    while _sends:
        _sends.popleft()[0].wait()
    buf = torch.stack([hidden, residual])                # [2, T, hidden]
    _sends.append((dist.isend(buf, dst=_stage.next_rank), buf))


def recv_activations(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous stage's output for a step of num_tokens tokens: (hidden, residual)."""
    buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
    dist.recv(buf, src=_stage.prev_rank)
    return buf[0], buf[1]
