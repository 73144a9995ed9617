"""The engine is transactional per call and per step (issue 35, item 1): a failure
injected once at each stage of a step -- the front door's input check, the compiled
step's own checks, the metadata build, the compiled forward, sampling, and (PD
consumer) the KV import -- leaves every KV block free and no request in the scheduler,
and the same request then gets exactly the tokens a fresh engine gives it.

Two front ends: `hf.Engine.generate`, and the `Driver` (under `LLM` and the server)
over a `LocalExecutor`, stepped bare with `run_until_done()` as the server steps it --
no caller-side `drop`, so the step itself has to clean up.

Where a stage does real work before failing (the metadata build allocates blocks; the
forward writes the cache), the fault is raised after that work: the failure that
leaves the most behind. The stage fails on its second call (the first decode step,
blocks already held from the prefill) unless it runs once per request (input checks,
the KV import).

The KV import runs over a fake import (`_FakeImportExecutor.call`) rather than NIXL:
a real consumer needs a producer world and a transport, not cheap in one process. The
fake does what `KVConsumer.import_request` leaves on the rank -- the request's blocks
allocated and holding the prompt's KV, plus the producer's first token -- by prefilling
the prompt into the request's blocks on the same engine, then raises: a rank that
fails after it allocated (the error-reply path, where the rank frees the blocks itself,
is covered by tests/entrypoints/test_llm_pd_disagg.py).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import cp_compile
import cp_compile.compiler.decorator as decorator_mod
import cp_compile.serving.hf.engine as engine_mod
from cp_compile.base.sampling import Sampler, SamplingParams
from cp_compile.serving.entrypoints.driver import Driver
from cp_compile.serving.entrypoints.executors import LocalExecutor
from cp_compile.serving.entrypoints.kv_driver import ConsumerSide
from cp_compile.serving.hf.engine import Engine
from cp_compile.serving.loop.scheduler import Scheduler, StepPlan
from cp_compile.serving.kv_transfer import KVTransferConfig
from examples.hf_generate import tiny_hf

BLOCK = 4
NUM_BLOCKS = 6
PROMPT = [3, 1, 4, 1, 5, 9, 2]  # 7 tokens: 2 blocks at the prefill, a third at the second decode
MAX_NEW = 5
SAMPLED = SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_NEW)  # seeded: the sampler's state counts too
PRODUCER = "prefill-0"
KV_PARAMS = dict(do_remote_prefill=True, remote_engine_id=PRODUCER, remote_request_id=0, remote_host="127.0.0.1",
                 remote_port=5600, num_tokens=len(PROMPT))


class InjectedFault(RuntimeError):
    """The fault a test injects (never raised by the code under test)."""


def _fail_once(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, at: int, after: bool = False) -> list[int]:
    """Make `owner.name` raise InjectedFault on its `at`-th call (after doing the real
    work when `after`); every other call goes through. Returns the call log."""
    real: Callable[..., Any] = getattr(owner, name)
    calls: list[int] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == at:
            if after:
                real(*args, **kwargs)
            raise InjectedFault(f"{name} failed on call {at}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def _engine() -> Engine:
    # One engine per case, each compiled afresh: without a reset the shared code objects
    # hit dynamo's recompile limit. No earlier engine runs again after this.
    torch._dynamo.reset()
    return Engine(tiny_hf("llama"), cp_compile.CPConfig(block_size=BLOCK), num_blocks=NUM_BLOCKS, lowering="eager")


def _all_free(engine: Engine) -> None:
    assert engine.alloc.num_free == NUM_BLOCKS  # a fresh engine's count
    assert engine.alloc._tables == {}


def _empty(sched: Scheduler) -> None:
    assert not sched.waiting and not sched.running and sched.reserved == 0 and sched._free == []


# ---- Engine.generate ---------------------------------------------------------------

ENGINE_STAGES = ["input", "step_checks", "metadata", "forward", "sample"]


def _inject(monkeypatch: pytest.MonkeyPatch, stage: str, engine: Engine, driver: Driver | None = None) -> list[int]:
    if stage == "input":  # the front door, before anything is taken
        if driver is not None:
            return _fail_once(monkeypatch, driver, "check", at=1)
        return _fail_once(monkeypatch, engine, "_check_generate", at=1)
    if stage == "step_checks":  # CompiledForward's validate_forward_args, before any cache write
        return _fail_once(monkeypatch, decorator_mod, "validate_forward_args", at=2)
    if stage == "metadata":  # after build_attention_metadata took the step's blocks
        return _fail_once(monkeypatch, engine_mod, "build_attention_metadata", at=2, after=True)
    if stage == "forward":  # after the compiled step wrote the cache
        return _fail_once(monkeypatch, engine, "compiled", at=2, after=True)
    if stage == "sample":
        return _fail_once(monkeypatch, Sampler, "sample", at=2)
    raise AssertionError(stage)


@pytest.fixture(scope="module")
def fresh_greedy() -> list[int]:
    out = _engine().generate([PROMPT], max_new_tokens=MAX_NEW)[0]
    assert len(out) == MAX_NEW
    return out


@pytest.mark.parametrize("stage", ENGINE_STAGES)
def test_engine_generate_is_transactional_at_each_stage(stage, fresh_greedy, monkeypatch):
    engine = _engine()
    made: list[Scheduler] = []
    make = engine.scheduler
    monkeypatch.setattr(engine, "scheduler", lambda: made.append(make()) or made[-1])
    calls = _inject(monkeypatch, stage, engine)
    with pytest.raises(InjectedFault):
        engine.generate([PROMPT], max_new_tokens=MAX_NEW)
    assert calls  # the stage was reached
    _all_free(engine)
    for sched in made:
        _empty(sched)
    assert engine.generate([PROMPT], max_new_tokens=MAX_NEW) == [fresh_greedy]
    _all_free(engine)


# ---- the Driver (LLM's and the server's loop), stepped bare ------------------------


class _FakeImportExecutor(LocalExecutor):
    """A kv_consumer rank whose import is faked in process (module doc): the producer's
    request 0 is PROMPT, prefilled greedily."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.imports = 0
        self.fail_at = 0  # the import call that raises after doing its work (0: none)

    def call(self, kind: str, payload: Any) -> list[Any]:
        assert kind == "kv_import"
        self.imports += 1
        out = []
        for remote_id, local_id in payload:
            assert remote_id == 0
            # What KVConsumer.import_request leaves: the blocks, holding the prompt's KV.
            logits = self.engine.execute(StepPlan([(local_id, 0, list(PROMPT))]))[0]
            out.append(dict(error=None, num_tokens=len(PROMPT), first_token=int(logits.argmax()), bytes_moved=0,
                            seconds=0.0, src_ranks=[0], descriptors=0))
        if self.imports == self.fail_at:
            raise InjectedFault("kv_import failed after allocating")
        return [out]


def _driver(consumer: bool = False) -> tuple[Driver, Engine, _FakeImportExecutor]:
    engine = _engine()
    ex = _FakeImportExecutor(engine)
    side = None
    if consumer:
        side = ConsumerSide(KVTransferConfig.from_dict(dict(
            kv_role="kv_consumer", engine_id="decode-0", kv_port=5600, kv_connector_extra_config={"remote_engine_id": PRODUCER})))
    return Driver(ex, ex.limits, seed=0, kv_side=side), engine, ex


def _serve(driver: Driver, kv: dict | None = None) -> list[int]:
    seq = driver.add(list(PROMPT), SAMPLED, kv_transfer_params=kv)
    driver.run_until_done()
    assert seq.finish_reason == "length"
    return seq.output


@pytest.fixture(scope="module")
def fresh_driver_tokens() -> dict[str, list[int]]:
    plain = _serve(_driver()[0])
    imported = _serve(_driver(consumer=True)[0], KV_PARAMS)
    assert len(plain) == len(imported) == MAX_NEW
    return dict(plain=plain, imported=imported)


@pytest.mark.parametrize("stage", ENGINE_STAGES + ["kv_import"])
def test_driver_step_is_transactional_at_each_stage(stage, fresh_driver_tokens, monkeypatch):
    consumer = stage == "kv_import"
    driver, engine, ex = _driver(consumer)
    kv = KV_PARAMS if consumer else None
    if consumer:
        ex.fail_at = 1
        calls = [1]
    else:
        calls = _inject(monkeypatch, stage, engine, driver)
    with pytest.raises(InjectedFault):
        _serve(driver, kv)
    assert calls and (not consumer or ex.imports == 1)  # the stage was reached
    _all_free(engine)
    _empty(driver.scheduler)
    assert not driver.has_work()
    assert _serve(driver, kv) == fresh_driver_tokens["imported" if consumer else "plain"]
    _all_free(engine)
    _empty(driver.scheduler)


# ---- what a failure leaves alone -----------------------------------------------------


def test_engine_execute_that_raises_gives_back_only_that_steps_blocks(monkeypatch):
    """`Engine.execute` on its own (a rank's executor): a step that raises after taking
    blocks (a decode growing into a new block beside a joining prefill) leaves the
    allocator as before the step; the same plan then runs."""
    engine = _engine()
    engine.execute(StepPlan([(0, 0, list(PROMPT) + [7])]))  # 8 tokens: 2 blocks
    held, free = engine.alloc.blocks(0), engine.alloc.num_free
    calls = _fail_once(monkeypatch, engine, "compiled", at=1, after=True)
    plan = StepPlan([(0, 8, [5]), (1, 0, list(PROMPT))])  # request 0 needs a third block, request 1 two
    with pytest.raises(InjectedFault):
        engine.execute(plan)
    assert len(calls) == 1
    assert engine.alloc.blocks(0) == held and 1 not in engine.alloc._tables and engine.alloc.num_free == free
    assert len(engine.execute(plan)) == 2
    assert engine.alloc.num_free == free - 3


def test_a_failed_step_fails_its_requests_and_leaves_the_waiting_ones(fresh_driver_tokens, monkeypatch):
    """Two requests fill the cache (3 blocks each of 6), a third waits; the second step
    raises: the two it ran fail ("error") with their blocks back, the waiting one is
    untouched and then gets a fresh engine's tokens."""
    driver, engine, _ = _driver()
    _inject(monkeypatch, "forward", engine)
    seqs = [driver.add(list(PROMPT), SAMPLED) for _ in range(3)]
    with pytest.raises(InjectedFault):
        driver.run_until_done()
    assert [s.finish_reason for s in seqs] == ["error", "error", None]
    assert list(driver.scheduler.waiting) == [seqs[2]] and not driver.scheduler.running
    _all_free(engine)
    driver.run_until_done()
    assert seqs[2].output == fresh_driver_tokens["plain"] and seqs[2].finish_reason == "length"
    _all_free(engine)
    _empty(driver.scheduler)


class _RefusingImportExecutor(_FakeImportExecutor):
    """A consumer rank whose import is refused with a verdict (the rank freed the blocks)."""

    def call(self, kind: str, payload: Any) -> list[Any]:
        return [[dict(error="KVTransferError: producer gone") for _ in payload]]


def test_a_refused_import_fails_only_its_request(fresh_driver_tokens):
    """The verdict path (unchanged): the import's request fails with KVTransferError, a
    request already decoding goes on and gets a fresh engine's tokens."""
    from cp_compile.serving.kv_transfer import KVTransferError

    engine = _engine()
    ex = _RefusingImportExecutor(engine)
    side = ConsumerSide(KVTransferConfig.from_dict(dict(
        kv_role="kv_consumer", engine_id="decode-0", kv_port=5600, kv_connector_extra_config={"remote_engine_id": PRODUCER})))
    driver = Driver(ex, ex.limits, seed=0, kv_side=side)
    plain = driver.add(list(PROMPT), SAMPLED)
    driver.step()  # the plain request's prefill
    imported = driver.add(list(PROMPT), SAMPLED, kv_transfer_params=KV_PARAMS)
    with pytest.raises(KVTransferError, match="producer gone"):
        driver.step()
    assert imported.finish_reason == "abort" and plain.finish_reason is None
    driver.run_until_done()
    assert plain.output == fresh_driver_tokens["plain"]
    _all_free(engine)
    _empty(driver.scheduler)
