"""lm-evaluation-harness against `conveyor serve`, as a user runs it: `local-completions` with the
server's own tokenizer (`tokenizer_backend=remote`), on the small local tasks in tests/lm_eval/.
The loglikelihoods (echo + logprobs over /v1/completions) and so the multiple-choice accuracy
equal lm-eval's `hf` model on the same GGUF weights; the generate-until answers are the same
greedy text."""
from pathlib import Path

import pytest
from serve_util import start_server

from conveyor.shared.model_files import DEFAULT_MODEL_NAME, default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(not default_model_path().is_file(),
                                 reason="default model not fetched (make model)")]

ROOT = Path(__file__).resolve().parents[2]
TASKS = ["conveyor_mc", "conveyor_gen"]
KEY = "lm-eval-key"


def evaluate(model: str, model_args: dict) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    # NOTE: only our tasks: indexing lm-eval's thousands of built-in ones takes ~10 s
    tasks = TaskManager(include_path=str(ROOT / "tests" / "lm_eval"), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                                   log_samples=True, task_manager=tasks)


def by_doc(result: dict, task: str) -> list:
    return [s["filtered_resps"] for s in sorted(result["samples"][task],
                                                key=lambda s: s["doc_id"])]


def test_local_completions_scores_as_the_hf_model_does(monkeypatch, hf_default_model):
    pytest.importorskip("lm_eval")
    monkeypatch.chdir(ROOT)                  # the tasks name their data files from here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    server = start_server("--api-key", KEY)
    try:
        ours = evaluate("local-completions", {
            "base_url": f"{server.http}/v1/completions", "model": DEFAULT_MODEL_NAME,
            "tokenizer_backend": "remote", "auth_token": KEY, "num_concurrent": 1,
            "max_retries": 1})
    finally:
        server.kill_all()
    # transformers' load of the same file (float32, CPU), shared with other tests; lm-eval's
    # `hf` reads the tokenizer from the file
    hf = evaluate("hf", {"pretrained": hf_default_model, "gguf_file": default_model_path().name,
                         "batch_size": 1})

    mc_ours, mc_hf = by_doc(ours, "conveyor_mc"), by_doc(hf, "conveyor_mc")
    assert len(mc_ours) == len(mc_hf) == 8
    for doc_ours, doc_hf in zip(mc_ours, mc_hf):
        assert len(doc_ours) == len(doc_hf) >= 3         # one loglikelihood per choice
        for (ll_ours, _), (ll_hf, _) in zip(doc_ours, doc_hf):
            assert ll_ours == pytest.approx(ll_hf, abs=1e-3)
    acc = ours["results"]["conveyor_mc"]["acc,none"]
    assert acc == pytest.approx(hf["results"]["conveyor_mc"]["acc,none"], abs=1e-3)
    assert acc >= 0.5                                   # it is answering, not guessing

    gen_ours, gen_hf = by_doc(ours, "conveyor_gen"), by_doc(hf, "conveyor_gen")
    assert len(gen_ours) == 4 and gen_ours == gen_hf
    score = ours["results"]["conveyor_gen"]["exact_match,last_word"]
    assert score == pytest.approx(hf["results"]["conveyor_gen"]["exact_match,last_word"])
    assert score >= 0.25
