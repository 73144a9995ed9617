"""The host-side scheduler: admission by whole KV budget, joins beside decodes,
leaving at max_tokens / EOS, aborts freeing blocks through the next plan; the step
loop over it (StepLoop: sampling, rank 0's tokens shared, a failed step dropped)."""

from __future__ import annotations

import pytest
import torch

from cp_compile.serving.loop.scheduler import Scheduler, Sequence, StepPlan
from cp_compile.serving.loop.step_loop import RequestState, StepLoop
from cp_compile.base.sampling import SamplingParams
from cp_compile.testing.multirank import run_on_ranks


def test_admission_join_leave_and_abort_free_blocks():
    s = Scheduler(num_blocks=6, virtual_block_size=4, max_batch=4)
    a = Sequence(0, [1, 2, 3], max_tokens=5)  # 8 tokens -> 2 blocks
    b = Sequence(1, [4] * 9, max_tokens=3)  # 12 tokens -> 3 blocks
    c = Sequence(2, [5, 6], max_tokens=6)  # 8 tokens -> 2 blocks: does not fit beside a and b
    for q in (a, b, c):
        s.add(q)
    plan = s.plan()
    assert [i[0] for i in plan.items] == [0, 1] and s.reserved == 5 and list(s.waiting) == [c]
    assert plan.items[0] == (0, 0, [1, 2, 3])  # prefill: the whole prompt
    s.commit([7, 8])
    plan = s.plan()
    assert plan.items == [(0, 3, [7]), (1, 9, [8])]  # decodes: one token each
    assert s.abort(1)  # the client went away
    plan = s.plan()  # its blocks are freed by this plan; c joins in the same step
    assert plan.free == [1] and [i[0] for i in plan.items] == [0, 2] and s.reserved == 4
    assert plan.items[1] == (2, 0, [5, 6])  # a prefill beside a decode
    done = s.commit([9, 10])
    assert done == [] and b.finish_reason == "abort"


def test_eos_and_length_finish():
    s = Scheduler(num_blocks=10, virtual_block_size=4, max_batch=4)
    a = Sequence(0, [1], max_tokens=3, eos=frozenset({2}))
    b = Sequence(1, [1], max_tokens=2)
    s.add(a), s.add(b)
    s.plan()
    assert s.commit([5, 5]) == []
    s.plan()
    done = s.commit([2, 6])  # a hits EOS, b its length
    assert {q.rid: q.finish_reason for q in done} == {0: "stop", 1: "length"}
    assert a.output == [5, 2] and s.reserved == 0 and s.plan().free == [0, 1]


def test_request_beyond_the_cache_refused_at_add():
    s = Scheduler(num_blocks=2, virtual_block_size=4, max_batch=4)  # 8 tokens
    with pytest.raises(ValueError, match="need 3 KV blocks"):
        s.add(Sequence(0, [1] * 6, max_tokens=4))


class _RankLogits:
    """An executor whose logits differ per rank: item i's argmax is 10 * rank + i."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.freed: list[int] = []

    def execute(self, plan: StepPlan) -> list[torch.Tensor]:
        self.freed += plan.free
        out = []
        for i, _ in enumerate(plan.items):
            lg = torch.zeros(32)
            lg[10 * self.rank + i] = 1.0
            out.append(lg)
        return out


def _loop_tokens(rank: int, world: int, share: bool) -> list[list[int]]:
    loop = StepLoop(_RankLogits(rank), Scheduler(8, 4, 4), share=share)
    seqs = [loop.submit(Sequence(i, [1, 2], 2, payload=RequestState(SamplingParams(temperature=0), None)))
            for i in range(2)]
    loop.run_until_done()
    return [s.output for s in seqs]


def test_step_loop_shares_rank_0s_tokens():
    """Under torchrun every rank runs the loop; rank 0's tokens are every rank's
    (cp_compile.base.sampling.share). Without sharing, rank 1 would follow its own logits."""
    assert run_on_ranks(_loop_tokens, 2, True) == [[[0, 0], [1, 1]]] * 2
    assert run_on_ranks(_loop_tokens, 2, False) == [[[0, 0], [1, 1]], [[10, 10], [11, 11]]]


def test_step_loop_drop_frees_every_request_now():
    ex = _RankLogits(0)
    loop = StepLoop(ex, Scheduler(8, 4, 1))  # one slot: the second request waits
    seqs = [loop.submit(Sequence(i, [1, 2], 4, payload=RequestState(SamplingParams(temperature=0), None)))
            for i in range(2)]
    loop.step()
    loop.drop(seqs)
    assert ex.freed == [0] and not loop.has_work() and loop.scheduler.reserved == 0
    assert [s.finish_reason for s in seqs] == ["abort", "abort"]


def test_draft_slots_delay_a_join_until_its_blocks_cover_them():
    """Speculative decoding (k = 3): a request's last step writes k - 1 positions past its
    budget, so it joins only when those blocks are free too; one that can never fit is
    refused at add, naming the draft slots."""
    s = Scheduler(num_blocks=5, virtual_block_size=4, max_batch=4, draft_slots=3)
    a, b = Sequence(0, [1, 2, 3], max_tokens=5), Sequence(1, [4, 5, 6], max_tokens=5)  # 8 (+ 2) tokens: 3 blocks
    s.add(a), s.add(b)
    plan = s.plan()
    assert [i[0] for i in plan.items] == [0] and s.reserved == 3 and list(s.waiting) == [b]
    with pytest.raises(ValueError, match=r"max_tokens=5 \+ 2 draft slots need 3 KV blocks"):
        Scheduler(num_blocks=2, virtual_block_size=4, max_batch=4, draft_slots=3).add(Sequence(2, [1] * 3, 5))


def test_commit_of_accepted_drafts_rolls_back_through_the_next_plan():
    """A verify step's a + 1 tokens: all but the last are cached, the last is the next
    input, and the next plan carries the rollback (tokens kept) of every request that
    wrote draft slots and goes on; tokens past a stop token or the length are dropped."""
    s = Scheduler(num_blocks=10, virtual_block_size=4, max_batch=4, draft_slots=2)
    a = Sequence(0, [1, 2, 3], max_tokens=8)
    b = Sequence(1, [4], max_tokens=8, eos=frozenset({9}))
    c = Sequence(2, [5], max_tokens=3)
    for q in (a, b, c):
        s.add(q)
    s.plan()
    s.commit([7, 8, 6])  # the prompts' first tokens: no draft slots, no rollback
    plan = s.plan()
    assert plan.truncate == [] and plan.items == [(0, 3, [7]), (1, 1, [8]), (2, 1, [6])]
    # a: 1 of 2 drafts accepted + its token; b: a stop token among its tokens; c: its length.
    done = s.commit([[10, 11], [12, 9, 13], [14, 15, 16]], drafts=[2, 2, 2])
    assert a.tokens == [1, 2, 3, 7, 10, 11] and a.cached == 5
    assert b.output == [8, 12, 9] and c.output == [6, 14, 15]
    assert {q.rid: q.finish_reason for q in done} == {1: "stop", 2: "length"}
    plan = s.plan()
    assert plan.truncate == [(0, 6)] and plan.free == [1, 2] and plan.items == [(0, 5, [11])]
