"""StepInputs against values worked out by hand: mixed steps (one padded for a CUDA graph), a
padded decode-only step."""
import torch

from conveyor.worker.step_inputs import StepInputs

BLOCK = 4


def inputs() -> StepInputs:
    return StepInputs(max_num_seqs=4, max_blocks_per_seq=3, block_size=BLOCK,
                      device=torch.device("cpu"))


def lists(out: dict[str, torch.Tensor]) -> dict[str, list]:
    return {name: t.tolist() for name, t in out.items()}


def test_mixed_step():
    si = inputs()
    si.add_blocks(2, 0, [7, 3])
    si.add_blocks(0, 0, [5])
    si.add_blocks(0, 1, [9])
    # slot 2 decodes position 5, its token taken from row 1 of the previous draw; slot 0
    # prefills positions 2..4. Logits rows: the last row of each, then slot 0's prompt
    # logprobs of positions 3 and 4 (predicted by rows 1 and 2).
    out = si.build(slots=[2, 0], input_ids=[0, 101, 102, 103], starts=[5, 2],
                   query_lens=[1, 3], seq_lens=[6, 5], logits_rows=[0, 3, 1, 2],
                   padded_tokens=4, padded_seqs=2,
                   gather_rows=[0], gather_from=[1], draw=torch.tensor([11, 42]))
    assert lists(out) == {
        "tokens": [[42, 101, 102, 103],
                   [5, 2, 3, 4],
                   [3 * BLOCK + 1, 5 * BLOCK + 2, 5 * BLOCK + 3, 9 * BLOCK + 0]],
        "seq_lens": [6, 5],
        "order": [],                       # not decode-only
        "query_start_loc": [0, 1, 4],
        "slots": [2, 0],
        "rows": [0, 3, 1, 2],
        "gather_rows": [0],
        "gather_from": [1],
        "write_at": [2 * 3 + 0, 2 * 3 + 1, 0, 1],
        "write_ids": [7, 3, 5, 9],
    }
    assert si.block_tables.tolist() == [[5, 9, 0], [0, 0, 0], [7, 3, 0], [0, 0, 0]]


def test_padded_decode_step_writes_only_new_entries():
    si = inputs()
    si.add_blocks(1, 0, [4])
    si.add_blocks(3, 0, [8])
    si.build(slots=[1, 3], input_ids=[1, 2], starts=[0, 0], query_lens=[1, 1],
             seq_lens=[1, 1], logits_rows=[0, 1], padded_tokens=2, padded_seqs=2,
             gather_rows=[], gather_from=[], draw=None)
    si.add_blocks(3, 1, [6])
    # two decodes padded to a graph batch of 4: padding rows get slot -1 and length 0
    out = si.build(slots=[1, 3], input_ids=[21, 22], starts=[2, 6], query_lens=[1, 1],
                   seq_lens=[3, 7], logits_rows=[0, 1], padded_tokens=4, padded_seqs=4,
                   gather_rows=[], gather_from=[], draw=None)
    assert lists(out) == {
        "tokens": [[21, 22, 0, 0],
                   [2, 6, 0, 0],
                   [4 * BLOCK + 2, 6 * BLOCK + 2, -1, -1]],
        "seq_lens": [3, 7, 0, 0],
        "order": [1, 0, 2, 3],             # longest context first
        "query_start_loc": [0, 1, 2, 2, 2],
        "slots": [1, 3],
        "rows": [0, 1],
        "gather_rows": [],
        "gather_from": [],
        "write_at": [3 * 3 + 1],
        "write_ids": [6],
    }
    assert si.block_tables.tolist() == [[0, 0, 0], [4, 0, 0], [0, 0, 0], [8, 6, 0]]


def test_mixed_step_padded_for_a_graph():
    si = inputs()
    si.add_blocks(0, 0, [2])
    si.add_blocks(1, 0, [6])
    # a decode and a 2-token chunk padded to 6 tokens and 4 sequences: padding sequences start
    # and end at the step's token count, padding tokens get slot -1
    out = si.build(slots=[0, 1], input_ids=[7, 8, 9], starts=[3, 0], query_lens=[1, 2],
                   seq_lens=[4, 2], logits_rows=[0, 2], padded_tokens=6, padded_seqs=4,
                   gather_rows=[], gather_from=[], draw=None)
    assert out["tokens"].tolist() == [[7, 8, 9, 0, 0, 0], [3, 0, 1, 0, 0, 0],
                                      [2 * BLOCK + 3, 6 * BLOCK, 6 * BLOCK + 1, -1, -1, -1]]
    assert out["seq_lens"].tolist() == [4, 2, 0, 0]
    assert out["query_start_loc"].tolist() == [0, 1, 3, 3, 3]
    assert out["order"].tolist() == []


def test_staging_buffers_take_turns_and_grow():
    si = inputs()
    si.add_blocks(0, 0, [1, 2, 3])
    for n in (1, 9, 2, 12):     # each step larger or smaller than the buffer's last use
        out = si.build(slots=[0], input_ids=list(range(n)), starts=[0], query_lens=[n],
                       seq_lens=[n], logits_rows=[n - 1], padded_tokens=n,
                       padded_seqs=1, gather_rows=[],
                       gather_from=[], draw=None)
        assert out["tokens"].tolist() == [list(range(n)), list(range(n)),
                                          [BLOCK * (1 + p // BLOCK) + p % BLOCK
                                           for p in range(n)]]
        assert out["query_start_loc"].tolist() == [0, n] and out["rows"].tolist() == [n - 1]


def test_lora_slots_per_token_and_grouped():
    """Each token's adapter slot is a fourth row of tokens (padding -1); lora_order lists the
    token rows of slot 0, then slot 1, ... (no-adapter tokens last), lora_starts cuts it."""
    si = inputs()
    for slot in range(3):
        si.add_blocks(slot, 0, [slot])
    out = si.build(slots=[0, 1, 2], input_ids=[1, 2, 3, 4, 5, 6], starts=[0, 0, 0],
                   query_lens=[1, 3, 2], seq_lens=[1, 3, 2], logits_rows=[0, 3, 5],
                   padded_tokens=8, padded_seqs=4, gather_rows=[], gather_from=[], draw=None,
                   lora_slots=[1, -1, 1], num_lora_slots=3)
    tokens = out["tokens"].tolist()
    assert len(tokens) == 4
    assert tokens[3] == [1, -1, -1, -1, 1, 1, -1, -1]
    assert out["lora_starts"].tolist() == [0, 0, 3, 3]
    assert out["lora_order"].tolist()[:3] == [0, 4, 5]
    assert sorted(out["lora_order"].tolist()) == list(range(8))


def test_an_entry_set_twice_before_a_step_is_written_once_with_its_last_value():
    """A draft's scratch entries are reset and the step's new blocks set at the same places
    before one copy: each index goes to the device once (index_put_ on CUDA writes duplicate
    indices in no set order), with the value set last."""
    si = inputs()
    si.add_blocks(1, 0, [4])
    si.add_blocks(1, 1, [30, 31])        # scratch entries of a proposal
    si.add_blocks(1, 1, [0, 0])          # reset once it is done
    si.add_blocks(1, 1, [6])             # the next step's new block
    out = si.build(slots=[1], input_ids=[1], starts=[4], query_lens=[1], seq_lens=[5],
                   logits_rows=[0], padded_tokens=1, padded_seqs=1, gather_rows=[],
                   gather_from=[], draw=None)
    assert sorted(zip(out["write_at"].tolist(), out["write_ids"].tolist())) == [
        (3, 4), (4, 6), (5, 0)]
    assert si.block_tables[1].tolist() == [4, 6, 0]
