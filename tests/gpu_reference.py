"""transformers as the reference on the GPU: its greedy tokens with each step's top-k, and
STYLE.md's rule against them (equal, or at the first divergence each side's token in the
other's top k)."""
import torch


def hf_greedy_with_tops(path, prompts: list[list[int]], new_tokens: int, top: int,
                        dtype: torch.dtype = torch.bfloat16) -> list:
    """(tokens, [top-k ids of each step]) per prompt, from transformers in `dtype` on the GPU;
    its memory is given back before this returns."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    hf = []
    with torch.inference_mode():
        for p in prompts:
            out = ref.generate(torch.tensor([p], device="cuda"), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, output_scores=True,
                               return_dict_in_generate=True, pad_token_id=0,
                               attention_mask=torch.ones(1, len(p), device="cuda",
                                                         dtype=torch.long))
            hf.append((out.sequences[0, len(p):].tolist(),
                       [s[0].float().topk(top).indices.tolist() for s in out.scores]))
    del ref
    torch.cuda.empty_cache()
    return hf


def assert_matches_hf(hf: list, outputs: list, what: str) -> None:
    """Each RequestOutput (with top-k logprobs) against its `hf_greedy_with_tops` entry."""
    for (hf_tokens, hf_tops), out in zip(hf, outputs):
        tokens = out.outputs[0].token_ids
        for j, (a, b) in enumerate(zip(tokens, hf_tokens)):
            if a != b:
                our_top = set(out.outputs[0].logprobs[j])
                assert a in hf_tops[j] and b in our_top, (
                    f"{what}: first divergence at token {j}: ours {a} (HF top {hf_tops[j]}), "
                    f"HF {b} (our top {sorted(our_top)})")
                break
