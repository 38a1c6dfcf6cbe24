"""One engine-core process: an `Engine` that steps whatever it has, takes requests and aborts between steps from a
pipe and sends each step's outputs and its stats back through it. `EngineCoreProcess` is the parent's handle."""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch.multiprocessing as mp
from tqdm import tqdm

from pagellm.config import EngineConfig
from pagellm.distributed.executor import die_with_parent

STOP_TIMEOUT_S = 10.0


class PipeSender:
    """Sends messages down a connection from a thread of its own, in order, so that a caller (the server's event
    loop) never waits for the other end to read: the engine's process reads between steps, and a message larger
    than the pipe's buffer held its sender until then. The caller pickles (as `Connection.send` does, so that
    `recv` reads it), so a message that cannot be pickled fails there and not in the thread. Best effort: once
    the other end is gone, what follows is dropped (the reader of the other direction reports the death)."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn = conn
        self._outbox: queue.SimpleQueue[bytes | memoryview | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, message: tuple) -> None:
        self._outbox.put(ForkingPickler.dumps(message))

    def close(self) -> None:
        """Ends the thread once what is queued has gone (or been dropped); call it when the other end has read
        what it will read or is gone, or it waits for that."""
        self._outbox.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (payload := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(payload)
            except OSError:
                pass


class EngineCoreProcess:
    """Starts the process; `wait_ready` waits for its engine. `name` says which one in errors."""

    def __init__(self, index: int, config: EngineConfig) -> None:
        self.index = index
        self.name = f"data-parallel replica {index}" if config.data_parallel_size > 1 else "the engine core"
        context = mp.get_context("spawn")
        self.conn, child_end = context.Pipe()
        # One engine sees the GPUs this process sees (under torchrun too); replica i gets [i * tp, (i + 1) * tp).
        gpus = None
        if config.data_parallel_size > 1 and config.resolve_device().type == "cuda":
            tp = config.tensor_parallel_size
            gpus = ",".join(str(g) for g in range(index * tp, (index + 1) * tp))
        # Not a daemon: a daemon may not start processes, and a tensor-parallel engine starts its other ranks. It
        # stops with `stop` (the client's finalizer runs it at exit too, before exit waits for its children), and
        # with this process however it goes (die_with_parent).
        self.process = context.Process(
            target=run_engine_core, args=(config, gpus, child_end), name=f"pagellm-core{index}", daemon=False
        )
        self.process.start()
        child_end.close()
        self._sender = PipeSender(self.conn, f"pagellm-core{index}-sender")

    def wait_ready(self) -> Any:
        """The engine's first stats, once it has started; raises if it failed or died first."""
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(f"{self.name} died while starting (exit code {self.process.exitcode})")
        try:
            kind, payload = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.name} died while starting (exit code {self.exit_code()})") from None
        if kind == "error":
            raise RuntimeError(f"{self.name} failed to start: {payload}")
        return payload

    def send(self, *message: Any) -> None:
        """Queued, not waited for (`PipeSender`); a process that is gone takes no more messages."""
        self._sender.send(message)

    def exit_code(self) -> int | None:
        self.process.join(timeout=1.0)
        return self.process.exitcode

    def stop(self) -> None:
        if self.process.is_alive():
            self.send("stop")
            self.process.join(timeout=STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._sender.close()
        self.conn.close()


def run_engine_core(config: EngineConfig, gpus: str | None, conn: Connection) -> None:
    """The process: messages from the parent are ("add", ProcessedRequest), ("abort", request id) and ("stop",);
    to it go ("ready", stats) or ("error", why) once, then ("step", outputs, stats) after every step and whenever
    the engine falls idle (so that an abort's freed blocks show), and ("stopped",) at the end."""
    die_with_parent()
    # tqdm's default lock holds a named semaphore, which this process leaves behind when it dies with its parent
    # (the resource tracker then warns of a leak at exit); its only bars, the weight loader's, need a thread lock.
    tqdm.set_lock(threading.RLock())
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    from pagellm.engine.engine import Engine  # after CUDA_VISIBLE_DEVICES

    try:
        engine = Engine(replace(config, data_parallel_size=1))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", engine.stats()))
    try:
        while True:
            if not engine.has_unfinished():
                conn.send(("step", [], engine.stats()))
                conn.poll(None)
            while conn.poll(0):  # what came during the step: taken in order, between steps
                kind, *args = conn.recv()
                if kind == "stop":
                    engine.shutdown()
                    conn.send(("stopped",))
                    return
                if kind == "add":
                    engine.enqueue(args[0])
                else:
                    engine.abort(args[0])
            if engine.has_unfinished():
                conn.send(("step", engine.step(), engine.stats()))
    except (EOFError, BrokenPipeError):  # the parent is gone
        engine.shutdown()
    except Exception as exc:  # a bug in the engine: the parent fails what this process ran
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
