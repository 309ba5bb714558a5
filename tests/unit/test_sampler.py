"""The sampler against torch reference computations: each parameter changes what is sampled."""
import pytest
import torch

from conveyor.shared.sampling_params import SamplingParams
from conveyor.shared.structured_outputs import StructuredOutputs
from conveyor.worker.sampler import Sampler, SeqSamplingState

V = 8
EOS = 7
NUM_DRAWS = 20000
TOL = 0.02  # on empirical frequencies of NUM_DRAWS draws (about 6 standard deviations)


def seq(prompt=(0,), output=(), **params) -> SeqSamplingState:
    return SeqSamplingState.new(SamplingParams(**params), [*prompt, *output], len(prompt), "cpu")


def sampler(vocab_size=V, seed=0) -> Sampler:
    return Sampler(vocab_size, (EOS,), seed, "cpu")


def frequencies(row: list[float], **params) -> torch.Tensor:
    """Empirical distribution of NUM_DRAWS samples of one logits row, drawn as one batch."""
    logits = torch.tensor([row]).repeat(NUM_DRAWS, 1)
    out = sampler(len(row)).sample(logits, [seq(**params) for _ in range(NUM_DRAWS)])
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(row)) / NUM_DRAWS


def renormalised(probs: list[float], keep: list[int]) -> torch.Tensor:
    kept = torch.zeros(len(probs))
    kept[keep] = torch.tensor(probs)[keep]
    return kept / kept.sum()


PROBS = [0.5, 0.3, 0.15, 0.05]
PROB_LOGITS = torch.tensor(PROBS).log().tolist()


def test_greedy_picks_argmax():
    logits = torch.randn(5, V)
    out = sampler().sample(logits, [seq(temperature=0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_greedy_rows_in_a_mixed_batch_pick_argmax():
    logits = torch.randn(6, V)
    states = [seq(temperature=0 if i % 2 else 1.0, logprobs=0 if i == 3 else None)
              for i in range(6)]
    out = sampler().sample(logits, states)
    assert out.token_ids[1::2] == logits[1::2].argmax(-1).tolist()


def test_plain_sampling_follows_softmax():
    row = [0.0, 1.0, 2.0, 0.5]
    freq = frequencies(row)
    assert torch.allclose(freq, torch.tensor(row).softmax(-1), atol=TOL)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_reshapes_the_distribution(temperature):
    row = torch.tensor([0.0, 1.0, 2.0, 0.5])
    expected = (row / temperature).softmax(-1)
    assert (expected - row.softmax(-1)).abs().max() > 3 * TOL  # the test can tell
    assert torch.allclose(frequencies(row.tolist(), temperature=temperature), expected, atol=TOL)


def test_top_k_never_samples_outside_the_top_k():
    freq = frequencies(PROB_LOGITS, top_k=2)
    assert torch.allclose(freq, renormalised(PROBS, [0, 1]), atol=TOL)
    assert freq[2:].sum() == 0


def test_top_p_keeps_the_smallest_set_reaching_p():
    freq = frequencies(PROB_LOGITS, top_p=0.75)  # 0.5 < 0.75 <= 0.5 + 0.3
    assert torch.allclose(freq, renormalised(PROBS, [0, 1]), atol=TOL)
    assert freq[2:].sum() == 0


def test_top_p_always_keeps_the_top_token():
    assert frequencies(PROB_LOGITS, top_p=0.01)[0] == 1


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # Top-3 renormalised: 0.526, 0.316, 0.158: 0.8 is reached by the first two.
    freq = frequencies(PROB_LOGITS, top_k=3, top_p=0.8)
    assert torch.allclose(freq, renormalised(PROBS, [0, 1]), atol=TOL)


def test_top_k_rows_and_full_width_rows_in_one_batch():
    # Top-k rows draw among their candidates only; the others from the whole vocabulary.
    logits = torch.tensor([PROB_LOGITS]).repeat(NUM_DRAWS, 1)
    states = [seq(top_k=2, min_p=0.7) if i % 2 else seq(top_p=0.75) for i in range(NUM_DRAWS)]
    out = torch.tensor(sampler(4).sample(logits, states).token_ids)
    # top-2 renormalised: 0.625, 0.375; min-p 0.7 drops 0.375 < 0.7 * 0.625
    assert (out[1::2] == 0).all()
    freq = torch.bincount(out[0::2], minlength=4) / (NUM_DRAWS // 2)
    assert torch.allclose(freq, renormalised(PROBS, [0, 1]), atol=2 * TOL)


def test_min_p_drops_tokens_below_min_p_times_the_top_probability():
    freq = frequencies(PROB_LOGITS, min_p=0.2)  # threshold 0.1: drops 0.05 only
    assert torch.allclose(freq, renormalised(PROBS, [0, 1, 2]), atol=TOL)
    assert freq[3] == 0


def greedy_token(row: list[float], prompt=(0,), output=(), **params) -> int:
    state = seq(prompt, output, temperature=0, **params)
    return sampler(len(row)).sample(torch.tensor([row]), [state]).token_ids[0]


def test_repetition_penalty_divides_positive_logits_of_prompt_tokens():
    row = [2.0, 1.8, 0.0, 0.0]
    assert greedy_token(row, prompt=(0,)) == 0
    assert greedy_token(row, prompt=(0,), repetition_penalty=1.5) == 1  # 2 / 1.5 < 1.8
    assert greedy_token(row, prompt=(2,), output=(3,), repetition_penalty=1.5) == 0


def test_repetition_penalty_multiplies_negative_logits_of_output_tokens():
    row = [-1.0, -1.1, -5.0, -5.0]
    assert greedy_token(row, prompt=(2,), output=(0,), repetition_penalty=1.2) == 1  # -1.2 < -1.1


def test_presence_penalty_counts_output_tokens_once():
    row = [2.0, 1.5, 0.0, 0.0]
    assert greedy_token(row, output=(0,), presence_penalty=1.0) == 1
    assert greedy_token(row, output=(0, 0, 0), presence_penalty=0.4) == 0  # once: 1.6 > 1.5
    assert greedy_token(row, prompt=(0,), output=(2,), presence_penalty=1.0) == 0  # prompt only


def test_frequency_penalty_scales_with_the_output_count():
    row = [2.0, 1.0, 0.5, 0.0]
    # 2 - 3 * 0.6 = 0.2 and 1 - 0.6 = 0.4 fall below 0.5; counted once, token 0 would still win.
    assert greedy_token(row, output=(0, 0, 0, 1), frequency_penalty=0.6) == 2
    assert greedy_token(row, prompt=(0, 0, 0, 0), output=(3,), frequency_penalty=0.6) == 0


def reference_penalties(row, prompt, output, rep, presence, freq) -> torch.Tensor:
    logits = torch.tensor(row)
    for t in set(prompt) | set(output):
        logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
    for t in set(output):
        logits[t] -= presence + freq * output.count(t)
    return logits


def test_penalties_together_match_a_reference_distribution():
    row, prompt, output = [1.0, 0.5, -0.3, 0.2, 0.8], [0, 2], [2, 3, 3, 1, 3]
    params = dict(repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1)
    logits = torch.tensor([row]).repeat(NUM_DRAWS, 1)
    states = [seq(prompt, output, **params) for _ in range(NUM_DRAWS)]
    out = sampler(len(row)).sample(logits, states)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=len(row)) / NUM_DRAWS
    expected = reference_penalties(row, prompt, output, 1.3, 0.2, 0.1).softmax(-1)
    assert (expected - torch.tensor(row).softmax(-1)).abs().max() > 3 * TOL
    assert torch.allclose(freq, expected, atol=TOL)


def test_penalised_and_plain_rows_in_one_batch():
    row = [2.0, 1.5, 0.0, 0.0]
    states = [seq(output=(0,), temperature=0), seq(output=(0,), temperature=0, presence_penalty=1)]
    out = sampler(4).sample(torch.tensor([row, row]), states)
    assert out.token_ids == [0, 1]


MIN_TOKENS_ROW = [0.0, 0.0, 0.0, 1.0, 0.0, 2.0, 0.0, 3.0]  # EOS (7) > stop id 5 > 3


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_bans_eos_and_stop_ids_until_reached(ignore_eos):
    params = dict(min_tokens=2, stop_token_ids=[5], ignore_eos=ignore_eos)
    assert greedy_token(MIN_TOKENS_ROW, output=(), **params) == 3
    assert greedy_token(MIN_TOKENS_ROW, output=(1,), **params) == 3
    assert greedy_token(MIN_TOKENS_ROW, output=(1, 1), **params) == EOS


def test_min_tokens_bans_every_eos_id_when_sampling():
    logits = torch.tensor([MIN_TOKENS_ROW]).repeat(1000, 1)
    states = [seq(min_tokens=1, stop_token_ids=[5]) for _ in range(1000)]
    out = Sampler(V, (EOS, 6), 0, "cpu").sample(logits, states)
    assert not {5, 6, EOS} & set(out.token_ids)


def bitmask(allowed: list[int]) -> torch.Tensor:
    """One structured-output mask row (int32 words) allowing these tokens of V."""
    return torch.tensor([[sum(1 << t for t in allowed)]], dtype=torch.int32)


@pytest.mark.parametrize("draw", [dict(temperature=0), dict(temperature=1.0, seed=3),
                                  dict(temperature=0.7, top_k=2, top_p=0.5)])
def test_a_row_its_constraints_leave_no_token_draws_eos(draw):
    """allowed_token_ids of end tokens only, below min_tokens; a grammar none of whose tokens
    allowed_token_ids lets through: EOS (the output ends) where all -inf would draw token 0."""
    row = torch.tensor([[3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, -1.0]])
    only_ends = seq(allowed_token_ids=[EOS, 5], stop_token_ids=[5], min_tokens=3, **draw)
    assert sampler().sample(row.clone(), [only_ends]).token_ids == [EOS]
    json = StructuredOutputs(regex="a")
    disjoint = seq(allowed_token_ids=[1, 2], structured_outputs=json, **draw)
    mask = (bitmask([3, 4]), torch.tensor([0]))
    assert sampler().sample_tensors(row.clone(), [disjoint], mask).output().token_ids == [EOS]
    # with a token left, the same request draws it
    some = seq(allowed_token_ids=[1, 3], structured_outputs=json, **draw)
    assert sampler().sample_tensors(row.clone(), [some], mask).output().token_ids == [3]
    assert sampler().sample(row.clone(), [seq(allowed_token_ids=[EOS, 4], min_tokens=3,
                                              **draw)]).token_ids == [4]


def test_bad_words_ban_their_last_token_after_the_rest():
    """A one-token bad word is never drawn; a longer one's last token only right after its
    other tokens (the output's, not the prompt's)."""
    row = torch.tensor([[0.0, 5.0, 4.0, 3.0, 0.0, 0.0, 0.0, -9.0]])
    words = [[1], [3, 2]]
    assert greedy_token(row[0].tolist(), bad_words_token_ids=words) == 2
    assert greedy_token(row[0].tolist(), output=(3,), bad_words_token_ids=words) == 3
    assert greedy_token(row[0].tolist(), prompt=(3,), bad_words_token_ids=words) == 2


def run_steps(sampler_seed: int, batch: list[SeqSamplingState], logits: torch.Tensor,
              steps: int = 10) -> list[list[int]]:
    """Samples `steps` times; returns the tokens of each row over the steps."""
    s = sampler(logits.shape[1], sampler_seed)
    tokens = [s.sample(logits, batch).token_ids for _ in range(steps)]
    return [list(t) for t in zip(*tokens)]


def test_seeded_rows_are_reproducible_whatever_the_batch():
    torch.manual_seed(0)
    row = torch.randn(1000)
    alone = run_steps(0, [seq(seed=42)], row[None])[0]
    batch = [seq(), seq(seed=7, temperature=0.8, top_p=0.9), seq(temperature=0), seq(seed=42)]
    logits = torch.stack([torch.randn(1000), torch.randn(1000), torch.randn(1000), row])
    assert run_steps(1, batch, logits)[3] == alone
    assert run_steps(0, [seq(seed=42), seq()], torch.stack([row, row]))[0] == alone


def test_seeded_top_k_rows_are_reproducible_whatever_the_batch():
    torch.manual_seed(0)
    row = torch.randn(1000)
    alone = run_steps(0, [seq(seed=5, top_k=10)], row[None])[0]
    batch = [seq(top_k=50), seq(seed=5, top_k=10), seq(temperature=0), seq(top_p=0.5)]
    logits = torch.stack([torch.randn(1000), row, torch.randn(1000), torch.randn(1000)])
    assert run_steps(1, batch, logits)[1] == alone
    assert set(alone) <= set(row.topk(10).indices.tolist())


def test_different_seeds_differ():
    row = torch.zeros(1, 1000)
    assert run_steps(0, [seq(seed=1)], row) != run_steps(0, [seq(seed=2)], row)


def test_unseeded_rows_follow_the_sampler_seed():
    row = torch.zeros(2, 1000)
    assert run_steps(3, [seq(), seq()], row) == run_steps(3, [seq(), seq()], row)
    assert run_steps(3, [seq(), seq()], row) != run_steps(4, [seq(), seq()], row)


def check_logprobs(lp, raw_row: torch.Tensor, chosen: int, k: int):
    expected = raw_row.log_softmax(-1)
    order = expected.argsort(descending=True).tolist()
    assert lp.token_ids == [chosen] + order[:k]
    assert lp.logprobs == pytest.approx(expected[lp.token_ids].tolist(), abs=1e-6)
    assert lp.rank == order.index(chosen) + 1


def test_logprobs_from_raw_logits_with_chosen_first():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    states = [seq(temperature=0, logprobs=0),
              seq(temperature=0.5, top_k=5, repetition_penalty=1.5, output=(4, 9), logprobs=3),
              seq()]
    out = sampler(50).sample(logits, states)
    check_logprobs(out.logprobs[0], logits[0], out.token_ids[0], 0)
    assert out.logprobs[0].rank == 1
    check_logprobs(out.logprobs[1], logits[1], out.token_ids[1], 3)
    assert out.logprobs[2] is None


def test_logprobs_rank_of_an_unlikely_choice():
    row = [0.0, 3.0, 2.0, 1.0]  # the penalty sinks token 1: greedy takes the raw second best
    state = seq(output=(1, 1, 1, 1), frequency_penalty=2.0, temperature=0, logprobs=2)
    out = sampler(4).sample(torch.tensor([row]), [state])
    assert out.token_ids == [2]
    check_logprobs(out.logprobs[0], torch.tensor(row), 2, 2)
    assert out.logprobs[0].rank == 2


def test_prompt_logprobs_match_a_direct_computation():
    torch.manual_seed(0)
    logits, targets = torch.randn(6, 30), [3, 0, 29, 7, 7, 12]
    result = sampler(30).prompt_logprob_tensors(logits, targets, 4).to_host().tolist()
    assert len(result) == 6
    for lp, row, target in zip(result, logits, targets):
        check_logprobs(lp, row, target, 4)


def test_columns_past_the_vocabulary_are_never_sampled():
    logits = torch.zeros(2, V + 4)
    logits[:, V:] = 100.0
    out = sampler().sample(logits, [seq(temperature=0), seq(logprobs=1)])
    assert all(t < V for t in out.token_ids)
    assert out.logprobs[1].logprobs[0] == pytest.approx(-torch.log(torch.tensor(V)).item())


def test_token_array_follows_the_appended_tokens():
    """The penalties read token_ids through an array converted as tokens arrive: it must equal
    token_ids after any number of appends (across its regrowths), and the penalties must see the
    latest tokens."""
    s = seq(prompt=range(5), output=(1, 2), temperature=1.0, presence_penalty=2.0)
    for step in range(200):
        assert s.token_array().tolist() == s.token_ids
        s.token_ids.append(step % V)
    logits = torch.zeros(1, V)
    s = seq(prompt=(0,), output=(3,), temperature=0, presence_penalty=2.0)
    sam = sampler()
    assert sam.sample(logits, [s]).token_ids[0] != 3       # 3 is penalised; ties take the first
    s.token_ids.append(0)
    assert sam.sample(logits, [s]).token_ids[0] not in (0, 3)


def test_logit_bias_adds_to_the_logits_of_its_rows_only():
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 3)
    states = [seq(temperature=0, logit_bias={1: 5.0}), seq(temperature=0),
              seq(temperature=0, logit_bias={0: -100.0, 3: 0.5}, logprobs=1)]
    out = sampler().sample(logits, states)
    assert out.token_ids == [1, 0, 1]
    # returned logprobs are the model's, before the bias (vLLM's default)
    assert out.logprobs[2].logprobs[0] == pytest.approx(logits[0].log_softmax(-1)[1].item())
    # sampled rows: the bias reshapes the distribution as softmax(logits + bias)
    freq = frequencies(PROB_LOGITS, logit_bias={3: float(torch.tensor(6.0).log())})
    biased = torch.tensor(PROBS) * torch.tensor([1, 1, 1, 6.0])
    assert torch.allclose(freq, biased / biased.sum(), atol=TOL)


def test_logit_bias_is_checked():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
