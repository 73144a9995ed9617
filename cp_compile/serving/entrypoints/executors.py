"""Where the ranks run: in this process (world 1), or in spawned worker processes.

`EngineArgs` (vLLM's names) says what to build; `build_engine` builds it on one rank
(init_parallel, this rank's TP shard of the local checkpoint read straight from its
safetensors files (`serving/hf/rank_load.py`), `cp_compile.serving.hf.Engine`).

`SpawnedExecutor` starts `world = tensor_parallel_size * prefill_context_parallel_size`
worker processes (`python -m cp_compile.serving.entrypoints.worker`, CPU gloo ranks through
torch.distributed's env:// rendezvous). Plain subprocesses, not multiprocessing
spawn: spawn re-imports the caller's `__main__`, which breaks a script without an
`if __name__ == "__main__":` guard (the seed's offline example has none). Each
worker connects back over a local authenticated socket
(`multiprocessing.connection`); every step the driver sends the plan to every rank
and waits for every rank's reply (rank 0's carries the last-token logits), so a
rank that fails is reported with its traceback instead of hanging the others.
"""

from __future__ import annotations

import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

import torch

from cp_compile.base.config import ConfigError, CPConfig
from cp_compile.serving.entrypoints.driver import Limits
from cp_compile.serving.hf.engine import Engine
from cp_compile.serving.loop.scheduler import StepPlan
from cp_compile.serving.entrypoints import kv_rank
from cp_compile.serving.hf.gathered_weights import gathered_weight_bytes
from cp_compile.serving.hf.kv_budget import bytes_per_block, check_budget, plan_pool, scale_bytes_per_block
from cp_compile.serving.hf.kv_scales import read_kv_scales
from cp_compile.serving.hf.rank_load import checkpoint_dtype, load_rank_local
from cp_compile.serving.hf.support import attention_spec
from cp_compile.serving.kv_transfer import KVTransferConfig
from cp_compile.runtime.parallel_state import ParallelState, init_parallel

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass
class EngineArgs:
    model: str
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    block_size: int = 16
    dtype: str = "auto"  # the checkpoint's torch_dtype
    max_model_len: int | None = None
    enable_dsa_cp: bool = False
    max_num_seqs: int = 8
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None  # KV pool bytes per rank (kv_budget.py); None: max_model_len x max_num_seqs
    # The merge rewrites (issue 37): CPConfig's; their gathered weights are taken out of the budget.
    dcp_merge_fold: str = "off"
    dcp_project_before_merge: str = "auto"
    # "auto" (the model's dtype), "fp8_e4m3" or "int8": quantised pages with fp32 scales (issue 39,
    # docs/quant_kv.md); a checkpoint's static k_scale / v_scale are used with "fp8_e4m3" (decision 71).
    kv_cache_dtype: str = "auto"
    lowering: str = "auto"
    device: str = "cpu"
    kv_transfer_config: dict | None = None  # PD disaggregation role (kv_rank.py), as given to LLM
    # The most one step may take on the spawned ranks before the driver gives up on them
    # (a rank alive but not answering: stopped, deadlocked, or waiting in a collective on
    # such a peer); vLLM's multiproc executor bounds a step at 300 s too. It includes a
    # first step's compile, hence the margin. Decision 57.
    step_timeout_s: float = 300.0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.prefill_context_parallel_size

    def cp_config(self) -> CPConfig:
        return CPConfig(tensor_parallel_size=self.tensor_parallel_size,
                        decode_context_parallel_size=self.decode_context_parallel_size,
                        prefill_context_parallel_size=self.prefill_context_parallel_size,
                        cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size, block_size=self.block_size,
                        enable_dsa_cp=self.enable_dsa_cp, dcp_merge_fold=self.dcp_merge_fold,
                        dcp_project_before_merge=self.dcp_project_before_merge,
                        kv_cache_dtype=check_kv_cache_dtype(self.kv_cache_dtype))

    def validate(self) -> None:
        """The checks that need only config.json: the model is servable (by name) and
        the sizes fit its attention (CPConfig.validate_for), and the dtype is known."""
        import transformers

        hf_config = transformers.AutoConfig.from_pretrained(self.model)
        cfg = self.cp_config()
        cfg.validate_for(attention_spec(hf_config))
        dtype = self.torch_dtype(hf_config)
        t = self.step_timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t < float("inf"):
            raise ConfigError("step_timeout_s is a positive number of seconds", f"step_timeout_s={t!r}",
                              "pass step_timeout_s > 0 (default 300): the most one engine step may take on the "
                              "worker ranks, compile included")
        check_budget(self.kv_cache_memory_bytes)
        _max_model_len(self, hf_config)  # longer than the checkpoint's positions: refused here
        if self.kv_cache_memory_bytes is not None and self.num_kv_blocks is not None:
            raise ConfigError("one of num_kv_blocks / kv_cache_memory_bytes",
                              f"num_kv_blocks={self.num_kv_blocks}, kv_cache_memory_bytes={self.kv_cache_memory_bytes}",
                              "drop num_kv_blocks to size the pool from the bytes (or drop the bytes)")
        if self.kv_cache_memory_bytes is not None:  # refused here, before any rank starts, if too small
            plan_pool(cfg, bytes_per_block(cfg, hf_config, dtype), _max_model_len(self, hf_config), self.max_num_seqs,
                      self.kv_cache_memory_bytes,
                      reserved_bytes=gathered_weight_bytes(cfg, hf_config, dtype, self.kv_cache_memory_bytes))
        if cfg.kv_cache_dtype == "fp8_e4m3" and cfg.prefill_context_parallel_size > 1:
            # A checkpoint's static scales: malformed ones and PCP refused before any rank starts.
            if read_kv_scales(self.model, hf_config.num_hidden_layers):
                raise ConfigError("a checkpoint's static KV scales are served at prefill_context_parallel_size = 1",
                                  f"prefill_context_parallel_size={cfg.prefill_context_parallel_size}, "
                                  f"kv_cache_dtype='fp8_e4m3', {self.model} has k_scale / v_scale (decision 71)",
                                  "prefill_context_parallel_size=1 (dcp may be > 1), or kv_cache_dtype='int8'")
        elif cfg.kv_cache_dtype == "fp8_e4m3":
            read_kv_scales(self.model, hf_config.num_hidden_layers)  # malformed scales refused here
        if self.kv_transfer_config is not None:
            KVTransferConfig.from_dict(self.kv_transfer_config)

    def torch_dtype(self, hf_config: Any = None) -> torch.dtype:
        """The serving dtype: "auto" is the checkpoint's torch_dtype (fp32 if it names none)."""
        if self.dtype in ("auto",):
            if hf_config is None:
                import transformers

                hf_config = transformers.AutoConfig.from_pretrained(self.model)
            return checkpoint_dtype(hf_config)
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {sorted(_DTYPES)}") from None


# vLLM's --kv-cache-dtype names that mean something else here, with the name to use.
_VLLM_KV_DTYPES = {"fp8": "vLLM's 'fp8' (e4m3) is 'fp8_e4m3' here", "fp8_e5m2": "e5m2 is not built, use 'fp8_e4m3'",
                   "fp8_inc": "use 'fp8_e4m3'", "fp8_ds_mla": "use 'fp8_e4m3'",
                   "bfloat16": "the model's dtype is 'auto'", "float16": "the model's dtype is 'auto'"}


def check_kv_cache_dtype(value: Any) -> str:
    """`kv_cache_dtype` as CPConfig takes it, or ConfigError naming the value and the project's name
    for it (vLLM spells fp8 `--kv-cache-dtype fp8`; here the names say the format: fp8_e4m3)."""
    if value in ("auto", "fp8_e4m3", "int8"):
        return value
    hint = f"{_VLLM_KV_DTYPES[value]}; " if value in _VLLM_KV_DTYPES else ""
    raise ConfigError("kv_cache_dtype is auto|fp8_e4m3|int8", f"kv_cache_dtype={value!r}",
                      f"{hint}use 'auto' (the model's dtype), 'fp8_e4m3' or 'int8' (quantised pages with an fp32 "
                      "scale per token and KV head)")


def _max_model_len(args: EngineArgs, hf_config: Any) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
    if args.max_model_len is not None and args.max_model_len > model_max:
        # Never serve a shorter limit than asked without a word: a caller sizing its
        # prompts (or a KV budget) from max_model_len would be refused mid-trace.
        raise ConfigError(f"max_model_len at most the checkpoint's max_position_embeddings={model_max}",
                          f"max_model_len={args.max_model_len}",
                          f"pass max_model_len <= {model_max}, or raise max_position_embeddings in the "
                          "checkpoint's config.json if its rope scaling serves longer contexts")
    return min(args.max_model_len or min(model_max, 2048), model_max)


def build_engine(args: EngineArgs, init: bool = True, parallel: ParallelState | None = None) -> Any:
    """On one rank (after the env:// rendezvous when world > 1): the model and its engine.
    `init=False` uses the caller's `parallel` state (its init_parallel) instead of making one."""
    cfg = args.cp_config()
    state = parallel
    if init and (args.world_size > 1 or args.decode_context_parallel_size > 1):
        state = init_parallel(cfg, device=args.device)
    # Rank-local: this rank's TP shard straight from the safetensors files (rank_load.py);
    # the Engine sees the model is sharded already.
    live = state
    tp_rank = live.layout.tp.rank if live is not None else 0
    model = load_rank_local(args.model, cfg.tensor_parallel_size, tp_rank, live.tp_group if live is not None else None,
                            dtype=args.torch_dtype())
    max_len = _max_model_len(args, model.config)
    dtype = next(model.parameters()).dtype
    pool = plan_pool(cfg, bytes_per_block(cfg, model.config, dtype, tp_rank), max_len, args.max_num_seqs,
                     args.kv_cache_memory_bytes, args.num_kv_blocks,
                     reserved_bytes=gathered_weight_bytes(cfg, model.config, dtype, args.kv_cache_memory_bytes),
                     block_scale_bytes=scale_bytes_per_block(cfg, model.config, dtype, tp_rank))
    scales = read_kv_scales(args.model, model.config.num_hidden_layers)  # {} without k_scale / v_scale
    engine = Engine(model, cfg, num_blocks=pool.num_blocks, max_batch=args.max_num_seqs,
                                  max_model_len=max_len, lowering=args.lowering, progress=False, parallel=state,
                                  kv_scales=scales)
    if (live.rank if live is not None else 0) == 0:
        # start-up capacity report, once (and what was done with a checkpoint's KV scales)
        print("\n".join(pool.lines() + ([engine.kv_scales_note] if engine.kv_scales_note else [])), flush=True)
    engine.model_max_len = max_len  # the Engine clamps max_model_len to its KV capacity; the driver names both
    engine.kv_pool = pool
    if args.kv_transfer_config is not None:
        kv_rank.attach(engine, args.kv_transfer_config)
    return engine


def limits_of(engine: Any) -> Limits:
    return Limits(num_blocks=engine.num_blocks, virtual_block_size=engine.config.virtual_block_size,
                  max_batch=engine.max_batch, max_model_len=getattr(engine, "model_max_len", engine.max_model_len),
                  vocab_size=engine.model.config.vocab_size, eos_token_ids=tuple(sorted(engine.eos)))


class LocalExecutor:
    """The engine in this process (world 1, or this process is one torchrun rank)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.limits = limits_of(engine)
        self.capacity = [engine.capacity()]

    def execute(self, plan: StepPlan) -> list[torch.Tensor]:
        return self.engine.execute(plan)

    def call(self, kind: str, payload: Any) -> list[Any]:
        """A driver command (kv_rank.handle) on the rank; its reply in a list of one."""
        return [kv_rank.handle(self.engine, kind, payload)]

    def close(self) -> None:
        pass


def send_obj(conn: Connection, obj: Any) -> None:
    # Plain pickle, not Connection.send: torch registers shared-memory reducers with
    # multiprocessing's pickler, which need the processes to be multiprocessing children.
    conn.send_bytes(pickle.dumps(obj))


def recv_obj(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_state(pid: int) -> str:
    """A process's state letter from /proc, spelt out ("state T (stopped)"); "" where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            letter = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "state unknown"
    names = {"R": "running", "S": "sleeping", "D": "disk sleep", "T": "stopped", "t": "tracing stop", "Z": "zombie"}
    return f"state {letter} ({names.get(letter, '?')})"


# How long one compile on a rank may take (it says when it starts and ends one: worker.py);
# the step's own bound, step_timeout_s, is counted without it. As long as the start allows.
COMPILE_TIMEOUT_S = 900.0

# How long a rank's reported failure waits for a peer's death to become visible (the
# dead peer is then named as the cause); only failing steps pay it.
PEER_DEATH_GRACE_S = 2.0


class WorkerError(RuntimeError):
    """A worker rank failed; the message carries its traceback."""


class SpawnedExecutor:
    """`args.world_size` worker processes on this machine (see module doc)."""

    def __init__(self, args: EngineArgs, start_timeout: float = 900.0) -> None:
        self.world = args.world_size
        self.step_timeout_s = args.step_timeout_s
        self.steps_sent = 0
        self.broken: WorkerError | None = None  # set by the first failure (`_replies`)
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = self._listener.address
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(self.world),
                   CP_COMPILE_WORKER_KEY=key.hex(), CP_COMPILE_DRIVER=f"{host}:{port}",
                   TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1",
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.world))))
        self.procs = [subprocess.Popen([sys.executable, "-m", "cp_compile.serving.entrypoints.worker"],
                                       env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(self.world)]
        self.conns: list[Connection | None] = [None] * self.world
        try:
            self._accept_all(start_timeout)
            for conn in self.conns:
                send_obj(conn, asdict(args))
            replies = self._wait_replies("building the engine", start_timeout, f"{start_timeout:.0f} s")
        except BaseException:
            self.close(force=True)
            raise
        self.limits = replies[0]["limits"]
        self.capacity = [r["capacity"] for r in replies]

    def _accept_all(self, timeout: float) -> None:
        """Accept every worker's connection; a worker that dies first is reported."""
        def accept() -> None:
            for _ in range(self.world):
                conn = self._listener.accept()
                self.conns[recv_obj(conn)] = conn

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        deadline = time.monotonic() + timeout
        while t.is_alive():
            t.join(0.5)
            dead = [r for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead and t.is_alive():
                raise WorkerError(f"worker rank {dead[0]} exited with code {self.procs[dead[0]].returncode} before "
                                  "connecting (its stderr is above)")
            if time.monotonic() > deadline:
                raise WorkerError(f"workers did not connect within {timeout:.0f} s")

    @property
    def pids(self) -> list[int]:
        """The worker processes' pids, by rank (for /health and process managers)."""
        return [p.pid for p in self.procs]

    def dead_worker(self, besides: int | None = None) -> WorkerError | None:
        """A worker (other than rank `besides`) that exited, named with its pid and exit
        code; None while all run."""
        for r, p in enumerate(self.procs):
            if r != besides and p.poll() is not None:
                code = p.returncode
                how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
                    else f"code {code}"
                return WorkerError(f"worker rank {r} (pid {p.pid}) exited with {how} (its stderr is above)")
        return None

    def _error_reply(self, rank: int, payload: str) -> WorkerError:
        """Rank `rank` reported a failure (its traceback in `payload`)."""
        # A rank whose collective broke because a peer died reports first; the dead peer
        # is the cause to name (its own traceback never comes). The peer's exit can be
        # seen a moment after its sockets closed (the broken collective), so wait a
        # short grace for it before blaming the reporting rank.
        dead = self.dead_worker(besides=rank)
        deadline = time.monotonic() + PEER_DEATH_GRACE_S
        while dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self.dead_worker(besides=rank)
        if dead is not None:
            last = (payload.strip().splitlines() or [""])[-1]
            return WorkerError(f"{dead}; worker rank {rank} failed with it ({last})")
        return WorkerError(f"worker rank {rank} failed:\n{payload}")

    def _lost(self, rank: int, exc: BaseException) -> WorkerError:
        """Rank `rank`'s connection closed: the dead rank named once its exit is visible
        (PEER_DEATH_GRACE_S), else the broken connection itself."""
        deadline = time.monotonic() + PEER_DEATH_GRACE_S
        while (dead := self.dead_worker()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return dead or WorkerError(f"worker rank {rank} (pid {self.procs[rank].pid}): its connection to the driver "
                                   f"broke ({type(exc).__name__}: {exc})")

    def _silent(self, silent: list[int], what: str, bound: str) -> WorkerError:
        """The wait for `what` ran out: the ranks that did not answer, with pid and process
        state (a stopped rank shows as T; a rank waiting in a collective on a hung peer is
        silent too, so every silent rank is named)."""
        ranks = ", ".join(f"rank {r} (pid {self.procs[r].pid}, {_proc_state(self.procs[r].pid)})" for r in silent)
        return WorkerError(f"{what}: no answer within {bound} from worker {ranks}: alive but hung (stopped, "
                           "deadlocked, or waiting in a collective on a hung peer); if steps are legitimately this "
                           "slow, raise step_timeout_s (LLM) / --step-timeout-s (serve)")

    def _wait_replies(self, what: str, bound_s: float | None, bound: str) -> list[Any]:
        """Every rank's reply to the command just sent, waiting on all ranks at once.
        `bound_s` (None: no bound) limits the wait; a rank that starts a compile
        ("compiling" notice, worker.py) extends it to COMPILE_TIMEOUT_S from then, and once
        no rank compiles the rest of the command has `bound_s` again from the last notice.
        A dead rank is reported within a fraction of a second whichever rank it is: a
        live rank blocked in a collective with a dead one may never answer (gloo's own
        timeout is 30 min)."""
        replies: dict[int, Any] = {}
        compiling: set[int] = set()
        deadline = None if bound_s is None else time.monotonic() + bound_s
        while len(replies) < self.world:
            pending = {self.conns[r]: r for r in range(self.world) if r not in replies}
            for conn in wait(list(pending), timeout=0.25):
                r = pending[conn]
                try:
                    kind, payload = recv_obj(conn)
                except (EOFError, OSError) as exc:  # its end closed: the rank died (its exit named)
                    raise self._lost(r, exc) from exc
                if kind in ("compiling", "compiled"):
                    (compiling.add if kind == "compiling" else compiling.discard)(r)
                    if deadline is not None:
                        deadline = time.monotonic() + (COMPILE_TIMEOUT_S if compiling else bound_s)
                elif kind == "error":
                    raise self._error_reply(r, payload)
                else:
                    replies[r] = payload
            dead = self.dead_worker()
            if dead is not None:
                raise dead
            if deadline is not None and time.monotonic() > deadline and len(replies) < self.world:
                silent = [r for r in range(self.world) if r not in replies]
                raise self._silent(silent, what, f"COMPILE_TIMEOUT_S={COMPILE_TIMEOUT_S:g} (compiling: ranks "
                                   f"{sorted(compiling)})" if compiling else bound)
        return [replies[r] for r in range(self.world)]

    def _replies(self, what: str, bound_s: float | None, bound: str) -> list[Any]:
        """`_wait_replies`; a failure (a rank died, failed or did not answer in time)
        breaks the executor for good: the ranks' replies are out of step with the
        commands from then on, so every later command raises the same error at once (not
        after another step_timeout_s: the loop's cleanup plan after a failed step,
        StepLoop.fail, would wait that long again)."""
        try:
            return self._wait_replies(what, bound_s, bound)
        except WorkerError as exc:
            self.broken = exc
            raise

    def _send(self, msg: tuple) -> None:
        if self.broken is not None:
            raise WorkerError(f"the worker ranks failed earlier: {self.broken}")
        for conn in self.conns:
            send_obj(conn, msg)

    def execute(self, plan: StepPlan) -> list[torch.Tensor]:
        self.steps_sent += 1
        self._send(("step", plan))
        # One bound for the whole step on every rank (issue 35: a hung rank must not hang the server).
        replies = self._replies(f"step {self.steps_sent}", self.step_timeout_s,
                                f"step_timeout_s={self.step_timeout_s:g}")
        return list(replies[0]) if replies[0] is not None else []

    def call(self, kind: str, payload: Any, timeout: float | None = None) -> list[Any]:
        """A driver command (kv_rank.handle) on every rank; every rank's reply."""
        self._send((kind, payload))
        return self._replies(kind, timeout, f"{timeout or 0:g} s")

    def close(self, force: bool = False) -> None:
        for conn in self.conns:
            if conn is not None and not force:
                try:
                    send_obj(conn, ("close", None))
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=0.1 if force else 60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for conn in self.conns:
            if conn is not None:
                conn.close()
        self.conns = [None] * self.world
        self.procs = []
        self._listener.close()
