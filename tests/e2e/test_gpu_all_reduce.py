"""The engine's one-shot all-reduce (conveyor/worker/layers/parallel.py) on two GPUs, through
scripts/bench_allreduce.py: every size the engine sends through it is first checked against
NCCL's sum of the same random values; sizes past its 512 KB limit go to NCCL."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


def test_one_shot_matches_nccl_and_hands_large_messages_to_it():
    from bench_allreduce import main

    # [32, 4104] bf16 is 263 KB (taken), [33, 8192] 541 KB (not)
    for hidden, batches, taken in ((4104, "1,3,32", True), (8192, "33", False)):
        results = main(["--world-size", "2", "--hidden", str(hidden), "--layers", "4",
                        "--batch", batches, "--iters", "5"])
        for r in results:
            assert (r["one_shot_graph_us"] is not None) == taken, r
            assert r["allreduce_graph_us"] > 0
