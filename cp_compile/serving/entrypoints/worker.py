"""One worker rank started by `SpawnedExecutor` (`python -m cp_compile.serving.entrypoints.worker`).

Connects to the driver (CP_COMPILE_DRIVER, authenticated with CP_COMPILE_WORKER_KEY),
receives the `EngineArgs`, builds its engine (init_parallel over env:// with the
RANK / WORLD_SIZE / MASTER_* the driver set), then executes plans until told to
close. Rank 0 replies with the last-token logits; the others with None.
"""

from __future__ import annotations

import os
import traceback

from multiprocessing.connection import Client, Connection

from cp_compile.serving.entrypoints import kv_rank
from cp_compile.serving.entrypoints.executors import EngineArgs, build_engine, limits_of, recv_obj, send_obj
from cp_compile.runtime.parallel_state import destroy_parallel


def _notify_compiles(conn: Connection) -> None:
    """Tell the driver when a dynamo compile starts and ends on this rank ("compiling" /
    "compiled" before the step's reply; same thread, so in order): the driver's bound on a
    step (step_timeout_s) then does not count compiles, which get COMPILE_TIMEOUT_S
    (executors.py). Without dynamo's callback API the driver just sees a slower step."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # noqa: BLE001 - a torch without it: plain bound
        return
    callback_handler.register_start_callback(lambda _args: send_obj(conn, ("compiling", None)))
    callback_handler.register_end_callback(lambda _args: send_obj(conn, ("compiled", None)))


def main() -> None:
    host, port = os.environ["CP_COMPILE_DRIVER"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["CP_COMPILE_WORKER_KEY"]))
    rank = int(os.environ["RANK"])
    send_obj(conn, rank)
    engine = None
    try:

        args = EngineArgs(**recv_obj(conn))
        _notify_compiles(conn)
        engine = build_engine(args)
        send_obj(conn, ("ok", {"limits": limits_of(engine), "capacity": engine.capacity()}))
        while True:
            kind, plan = recv_obj(conn)
            if kind == "close":
                break
            if kind != "step":  # a PD-disaggregation command (kv_rank.py)
                send_obj(conn, ("ok", kv_rank.handle(engine, kind, plan)))
                continue
            last = engine.execute(plan)
            send_obj(conn, ("ok", [t.cpu() for t in last] if rank == 0 else None))
    except EOFError:  # the driver went away
        pass
    except BaseException:  # noqa: BLE001 - reported to the driver, which raises it
        try:
            send_obj(conn, ("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1)
    finally:
        if engine is not None:
            try:
                destroy_parallel()
            except Exception:  # noqa: BLE001 - world 1 has no parallel state
                pass
        conn.close()


if __name__ == "__main__":
    main()
