"""Speculative decoding through the one step loop (`SpecLoop`, a `StepLoop`), single
device, eager: draft-slot admission and a request that joins while another verifies.

Three requests whose budgets (prompt 7 + 9 new = 16 tokens) fill two blocks of 8
exactly; with k = 3 drafts their last verify step writes 2 positions more, a third
block. The cache has 6 blocks: the scheduler admits two, the third joins when the
first leaves. Test drafts (`_Drafts`): request 0's are the greedy tokens (all k
accepted, it leaves early), request 1's are always wrong (none accepted), so request
2 joins while request 1 is still verifying: its prompt is prefilled in the same step
as request 1's k + 1 verify tokens. The tokens must equal the greedy run without
speculation, and every block must come back.
"""

from __future__ import annotations

from typing import Any

import torch

import cp_compile
from examples import spec
from examples.models.tiny import VOCAB, hf_qwen3

BLOCK, NUM_BLOCKS, K, NEW = 8, 6, 3, 9


class _Drafts:
    """Wraps the proposer's forward: each request's last row picks the greedy token of
    the position it predicts (`seqs`: prompt + greedy output), + 1 for request 1."""

    def __init__(self, proposer: Any, seqs: dict[int, list[int]]) -> None:
        self.inner, self.seqs, self.rids = proposer.forward, seqs, []
        propose = proposer.propose

        def remember(rids: list[int], *args: Any, **kwargs: Any) -> Any:
            self.rids = list(rids)
            return propose(rids, *args, **kwargs)

        proposer.propose, proposer.forward = remember, self

    def __call__(self, *args: Any) -> torch.Tensor:
        logits = torch.zeros_like(self.inner(*args))
        positions, meta = args[1], args[-1]
        for rid, row in zip(self.rids, (meta.query_start_loc[1:].long() - 1).tolist()):
            seq = self.seqs[rid]
            pos = int(positions[row]) + 1
            tok = seq[pos] if pos < len(seq) else 0
            logits[row, (tok + 1) % VOCAB if rid == 1 else tok] = 1.0
        return logits


def test_draft_slots_admission_and_a_join_beside_a_verify_step():
    hf = hf_qwen3(num_kv_heads=2)
    sd, dcfg, dsd = spec.proposer_weights("draft", hf.config, dict(hf.state_dict()))
    cfg = cp_compile.CPConfig(block_size=BLOCK)
    g = torch.Generator().manual_seed(5)
    prompts = {r: torch.randint(0, VOCAB, (7,), generator=g).tolist() for r in range(3)}

    held: list[tuple[int, int, int]] = []  # per rollback: (blocks the request holds, its tokens need, given back)

    def run(k: int, seqs: dict[int, list[int]] | None = None):
        models = spec.build(cfg, hf.config, sd, "draft" if k else None, k, NUM_BLOCKS, draft_hf=(dcfg, dsd),
                            padding=1, max_blocks_per_req=4)
        if k:
            _Drafts(models.proposer, seqs)

        def rolled_back(r: Any) -> None:
            held.append((len(dec.alloc.blocks(r.req_id)), -(-(r.old_len + r.num_accepted + 1) // BLOCK),
                         len(r.freed)))

        dec = spec.decoder(models, cfg, NUM_BLOCKS, padding=1, max_blocks_per_req=4, on_rollback=rolled_back)
        return dec.generate(prompts, NEW), dec

    base, _ = run(0)
    res, dec = run(K, {r: prompts[r] + base.tokens[r] for r in prompts})
    assert res.tokens == base.tokens
    per_step = res.stats.accepted_per_step  # the verifying requests of each step, in batch order
    assert per_step[0] == [K, 0]  # requests 0 and 1 only: request 2 waits for blocks
    joined = next(i for i, step in enumerate(per_step) if len(step) == 1)  # request 0 left; 2 prefills beside 1
    assert per_step[joined] == [0] and len(per_step[joined + 1]) == 2, per_step
    # Rejected draft slots rolled back through the plan: each request then holds exactly
    # the blocks of its committed tokens (some rounds give a block back).
    assert held and all(h == n for h, n, _ in held) and any(f for _, _, f in held), held
    assert dec.alloc.num_free == NUM_BLOCKS
