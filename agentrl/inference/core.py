"""The engine core in a process of its own (``server_process = "split"``).

The HTTP front end (uvicorn, FastAPI routes, validation, chat rendering, tokenization,
response building) and the engine's model loop share one GIL when they share a process.
``split`` runs the :class:`~agentrl.inference.engine.Engine` and the engine's
:class:`~agentrl.weights.receive.WeightReceiver` in a child process, the *engine core*, and
gives the server a :class:`CoreClient` with the engine's surface:

- one socket pair, pickled messages, never a host port: the front end sends token-id
  prompts with their sampling parameters (``submit``), aborts (a client that went away) and
  calls (pause, resume, stats, versions, the receiver's weight pushes); the core sends each
  finished request's results, streaming requests' token events and call replies, batched:
  one message carries whatever the engine produced since the last one;
- weight pushes keep their routes in the front end; their bytes take the same way they
  take today: a shared-memory or disk push is written by the trainer straight into the
  segment or file the core made (only its path crosses the channel); an HTTP chunk's
  bytes are passed on once;
- the core ignores Ctrl-C and exits when its channel closes (the front end ended, however
  it ended) or its parent is gone; the front end stops it on close;
- a core that dies fails every request in flight and every later one with a 503 that says
  how it died (:data:`CORE_DIED`), and the server exits non-zero.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from agentrl.errors import EngineStartError, RequestError
from agentrl.heap import keep_freed_memory
from agentrl.inference.engine_args import EngineArgs
from agentrl.inference.launcher import end_process, exit_with_parent
from agentrl.inference.protocol import APIError
from agentrl.inference.requests import SequenceResult, TokenCallback, TokenEvent, check_request
from agentrl.inference.sampling import EngineSampling

CORE_DIED = "the engine core process died"  # how every 503 after a core's death starts
ENGINE_CALLS = ("pause", "resume", "is_paused", "version", "reset_prefix_cache", "stats")
RECEIVER_CALLS = ("begin", "chunk", "abort", "commit", "set_version", "load_disk", "max_bytes")


def _dump(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _result_tuple(r: SequenceResult) -> tuple:
    return (r.token_ids, r.logprobs, r.versions, r.top_logprobs, r.text, r.finish_reason, r.support)


def _event_tuple(e: TokenEvent) -> tuple:
    return (e.index, e.token_id, e.logprob, e.version, e.top_logprobs, e.finish_reason, e.text, e.support)


def _error_tuple(e: BaseException) -> tuple:
    if isinstance(e, RequestError):
        return ("request", str(e), e.code, e.param)
    return ("runtime", f"{type(e).__name__}: {e}", None, None)


def _raise(err: tuple) -> None:
    kind, message, code, param = err
    if kind == "request":
        raise RequestError(message, code=code, param=param)
    raise RuntimeError(message)


# ----------------------------------------------------------------------------- the core (child)


class _Outbox:
    """What the core hands the front end: the engine thread's results and token events, sent as
    one message per engine step (:attr:`Engine.on_step <agentrl.inference.engine.Engine.on_step>`),
    so the model loop never wakes another thread; call replies go out at once."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._items: list[tuple] = []
        self._queue_lock = threading.Lock()
        self._send_lock = threading.Lock()

    def put(self, item: tuple) -> None:
        """Queue an item for the next :meth:`flush`."""
        with self._queue_lock:
            self._items.append(item)

    def flush(self) -> None:
        with self._send_lock:  # taken before the queue: batches leave in the order they were taken
            with self._queue_lock:
                items, self._items = self._items, []
            if items:
                self._send(items)

    def send(self, items: list[tuple]) -> None:
        with self._send_lock:
            self._send(items)

    def _send(self, items: list[tuple]) -> None:
        try:
            self._conn.send_bytes(_dump(items))
        except OSError:  # the front end is gone: the reader ends the core
            pass


class _Core:
    """The core's side of the channel: the engine, its weight receiver, and the requests in flight."""

    def __init__(self, conn: Connection, engine: Any):
        self.conn, self.engine = conn, engine
        self.outbox = _Outbox(conn)
        engine.on_step = self.outbox.flush
        self.calls = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="agentrl-core-call")  # pause waits
        self.futures: dict[int, concurrent.futures.Future] = {}
        self.receiver: Any = None

    def serve(self) -> None:
        """Act on the front end's messages until it closes the channel (or dies)."""
        try:
            while True:
                try:
                    batch = pickle.loads(self.conn.recv_bytes())
                except (EOFError, OSError):
                    return
                for msg in batch:
                    if msg[0] == "close":
                        return
                    self.act(msg)
        finally:
            self.calls.shutdown(wait=False, cancel_futures=True)
            self.engine.close()
            if self.receiver is not None:
                self.receiver.close()  # its shared-memory files and private weights dir
            self.outbox.flush()  # what engine.close failed

    def act(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "s":  # submit: rid, prompt ids, sampling fields, n, stream
            _, rid, prompt_ids, sampling, n, stream = msg
            try:
                fut = self.engine.submit(prompt_ids, EngineSampling(**sampling), n,
                                         on_tokens=partial(self.tokens, rid) if stream else None)
            except Exception as e:
                self.outbox.send([("d", rid, None, _error_tuple(e))])
                return
            self.futures[rid] = fut
            fut.add_done_callback(partial(self.done, rid))
            if fut.done():  # finished before the callback was added: no engine step will flush it now
                self.outbox.flush()
        elif kind == "a":  # abort: the client went away
            fut = self.futures.get(msg[1])
            if fut is not None:
                fut.cancel()
        elif kind == "c":  # call: cid, target, name, args
            self.calls.submit(self.call, *msg[1:])

    def done(self, rid: int, fut: concurrent.futures.Future) -> None:  # engine thread (or the reader, on abort)
        self.futures.pop(rid, None)
        if fut.cancelled():
            return  # the front end aborted it: it expects nothing back
        exc = fut.exception()
        if exc is not None:
            self.outbox.put(("d", rid, None, _error_tuple(exc)))
        else:
            self.outbox.put(("d", rid, [_result_tuple(r) for r in fut.result()], None))

    def tokens(self, rid: int, events: list[TokenEvent]) -> None:  # engine thread
        self.outbox.put(("t", rid, [_event_tuple(e) for e in events]))

    def call(self, cid: int, target: str, name: str, args: tuple) -> None:  # a call thread
        try:
            if target == "receiver" and name in RECEIVER_CALLS and self.receiver is not None:
                value = getattr(self.receiver, name)(*args)
            elif target == "engine" and name == "make_receiver":
                from agentrl.weights.receive import WeightReceiver

                key, weights_dir, shm_parent = args
                self.receiver = WeightReceiver(self.engine, key, weights_dir=weights_dir, shm_parent=shm_parent)
                value = None
            elif target == "engine" and name in ("is_paused", "version"):
                value = getattr(self.engine, name)
            elif target == "engine" and name in ENGINE_CALLS:
                value = getattr(self.engine, name)(*args)
            else:
                raise RuntimeError(f"the engine core has no call {target}.{name}")
            self.outbox.send([("r", cid, value, None)])
        except Exception as e:
            self.outbox.send([("r", cid, None, _error_tuple(e))])


def _core(conn: Connection) -> None:
    """The core's life: build the engine, answer ``ready``, then serve messages until the channel closes."""
    from agentrl.inference.engine import Engine

    model_dir, args_dict = pickle.loads(conn.recv_bytes())
    try:
        engine = Engine(model_dir, EngineArgs(**args_dict))
    except EngineStartError as e:
        conn.send_bytes(_dump(("failed", str(e))))
        sys.exit(2)
    conn.send_bytes(_dump(("ready", {"vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len,
                                     "max_batch_size": engine.max_batch_size})))
    _Core(conn, engine).serve()


def core_main(argv: list[str] | None = None) -> None:
    """``python -m agentrl.inference.core --fd N --parent-pid P`` (started by :class:`CoreClient`)."""
    import argparse

    ap = argparse.ArgumentParser(prog="agentrl-engine-core")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the front end ends the core
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds serve(): its files are removed
    exit_with_parent(a.parent_pid)  # the front end is gone (even a SIGKILL): no orphaned core
    keep_freed_memory()
    _core(Connection(a.fd))
    sys.stderr.flush()
    os._exit(0)  # cleaned up already; skip tearing down torch's threads (slow on a loaded host)


# ----------------------------------------------------------------------------- the front end's side


class _Pending:
    __slots__ = ("future", "on_tokens")

    def __init__(self, future: concurrent.futures.Future, on_tokens: TokenCallback | None):
        self.future, self.on_tokens = future, on_tokens


class CoreClient:
    """The engine's surface (what :mod:`agentrl.inference.server` uses) over an engine-core process."""

    def __init__(self, model_dir: str | Path, args: EngineArgs, *, on_death: Callable[[str], None] | None = None,
                 startup_timeout: float | None = None):
        """Start the core and wait until its engine is loaded.  ``on_death(reason)`` is called
        (on the reader thread) if the core dies while serving.  Raises
        :class:`~agentrl.errors.EngineStartError` with the core's own one-line reason."""
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        self.args = args
        self.on_death = on_death
        self.failure: str | None = None  # why the core died (None while it lives)
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._outgoing: list[tuple] = []  # messages waiting for the event loop's next turn
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count(1)
        self._closing = False
        fd = theirs.fileno()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentrl.inference.core", "--fd", str(fd), "--parent-pid", str(os.getpid())],
            pass_fds=(fd,),
        )
        theirs.close()
        try:
            self._conn.send_bytes(_dump((str(self.model_dir), asdict(args))))  # the one message that is not a batch
            if startup_timeout is not None and not self._conn.poll(startup_timeout):
                raise EngineStartError(f"the engine core did not load the model within {startup_timeout:g}s")
            kind, info = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as e:
            rc = self.proc.wait()
            raise EngineStartError(f"the engine core exited with code {rc} while loading the model "
                                   "(its error is above in this log)") from e
        except BaseException:
            self._stop_proc()
            raise
        if kind == "failed":
            self.proc.wait()
            raise EngineStartError(info)
        self.vocab_size: int = info["vocab_size"]
        self.max_model_len: int = info["max_model_len"]
        self.max_batch_size: int = info["max_batch_size"]
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        except BaseException:
            self.close()
            raise
        self._reader = threading.Thread(target=self._read, name="agentrl-core-read", daemon=True)
        self._reader.start()

    # -- the engine's surface

    def submit(self, prompt_ids: list[int], sampling: EngineSampling, n: int = 1,
               on_tokens: TokenCallback | None = None) -> concurrent.futures.Future:
        """As :meth:`Engine.submit <agentrl.inference.engine.Engine.submit>`; the core runs it."""
        check_request(prompt_ids, n, self.vocab_size, self.max_model_len, self.max_batch_size)
        sampling.max_tokens = min(sampling.max_tokens, self.max_model_len - len(prompt_ids))
        fut: concurrent.futures.Future = concurrent.futures.Future()
        rid = next(self._ids)
        with self._lock:
            self._check_alive()
            self._pending[rid] = _Pending(fut, on_tokens)
        self._send(("s", rid, list(prompt_ids), asdict(sampling), n, on_tokens is not None), soon=True)
        fut.add_done_callback(lambda f: self._aborted(rid, f))
        return fut

    def _aborted(self, rid: int, fut: concurrent.futures.Future) -> None:
        if fut.cancelled():
            with self._lock:
                gone = self._pending.pop(rid, None)
            if gone is not None and self.failure is None:
                self._send(("a", rid), soon=True)

    def pause(self) -> None:
        self._call("engine", "pause")

    def resume(self) -> None:
        self._call("engine", "resume")

    @property
    def is_paused(self) -> bool:
        return self._call("engine", "is_paused")

    @property
    def version(self) -> int:
        return self._call("engine", "version")

    def reset_prefix_cache(self) -> None:
        self._call("engine", "reset_prefix_cache")

    def stats(self) -> dict[str, Any]:
        return self._call("engine", "stats")

    def receiver(self, key: str | None, weights_dir: str | Path | None, shm_parent: str | None) -> RemoteReceiver:
        """The core's :class:`~agentrl.weights.receive.WeightReceiver`, made there with these settings."""
        self._call("engine", "make_receiver", key, str(weights_dir) if weights_dir is not None else None, shm_parent)
        return RemoteReceiver(self)

    def close(self) -> None:
        """End the core (it removes its shared-memory files) and fail what is still pending."""
        self._closing = True
        if self.proc.poll() is None:
            try:
                self._send(("close",))
            except OSError:
                pass
        self._stop_proc()
        self._conn.close()
        self._fail_all(RuntimeError("engine closed"))

    # -- plumbing

    def _stop_proc(self, timeout: float = 10.0) -> None:
        try:  # the core ends on its own once its channel closes
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_process(self.proc, timeout)

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise APIError(503, self.failure, type_="ServiceUnavailableError", code="engine_core_died")

    def _send(self, msg: tuple, soon: bool = False) -> None:
        """Send ``msg`` (with whatever waits before it).  ``soon``: on an event loop's thread, wait
        for the loop's next turn, so the requests that arrived together cross as one message."""
        loop = None
        if soon:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                pass
        with self._send_lock:
            self._outgoing.append(msg)
            if loop is not None:
                if len(self._outgoing) == 1:
                    loop.call_soon(self._flush)
                return
            self._flush_locked()

    def _flush(self) -> None:
        with self._send_lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._outgoing:
            batch, self._outgoing = self._outgoing, []
            try:
                self._conn.send_bytes(_dump(batch))
            except OSError:  # the core is gone: the reader fails everything pending
                pass

    def _call(self, target: str, name: str, *args: Any) -> Any:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        cid = next(self._ids)
        with self._lock:
            self._check_alive()
            self._calls[cid] = fut
        self._send(("c", cid, target, name, args))
        return fut.result()

    def _read(self) -> None:
        """The reader thread: hand results, token events and replies to their waiters, until the core ends."""
        while True:
            try:
                items = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            for item in items:
                kind = item[0]
                if kind == "t":
                    p = self._pending.get(item[1])
                    if p is not None and p.on_tokens is not None:
                        try:
                            p.on_tokens([TokenEvent(*e) for e in item[2]])
                        except Exception:  # the consumer is gone (as in the engine): abort
                            p.future.cancel()
                elif kind == "d":
                    with self._lock:
                        p = self._pending.pop(item[1], None)
                    if p is None or p.future.done():
                        continue
                    if item[3] is not None:
                        try:
                            _raise(item[3])
                        except Exception as e:
                            p.future.set_exception(e)
                    else:
                        p.future.set_result([SequenceResult(*r) for r in item[2]])
                elif kind == "r":
                    with self._lock:
                        fut = self._calls.pop(item[1], None)
                    if fut is None:
                        continue
                    if item[3] is not None:
                        try:
                            _raise(item[3])
                        except Exception as e:
                            fut.set_exception(e)
                    else:
                        fut.set_result(item[2])
        if self._closing:
            return
        rc = self.proc.wait()
        how = f"killed by signal {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
        self.failure = f"{CORE_DIED} ({how}); the engine's log says why; restart the engine"
        self._fail_all(APIError(503, self.failure, type_="ServiceUnavailableError", code="engine_core_died"))
        if self.on_death is not None:
            self.on_death(self.failure)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for f in [p.future for p in pending] + calls:
            if not f.done():
                f.set_exception(exc)


class RemoteReceiver:
    """The weight routes' receiver when it lives in the engine core: each call runs there."""

    def __init__(self, client: CoreClient):
        self._client = client
        self._max_bytes: int | None = None

    def begin(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._client._call("receiver", "begin", body)

    def chunk(self, transfer: str, index: int, data: bytes, sig: str | None) -> None:
        self._client._call("receiver", "chunk", transfer, index, data, sig)

    def abort(self, transfer: str, sig: str | None) -> None:
        self._client._call("receiver", "abort", transfer, sig)

    def commit(self, transfer: str, sig: str | None, sha256: str | None = None) -> dict[str, Any]:
        return self._client._call("receiver", "commit", transfer, sig, sha256)

    def set_version(self, version: int, sig: str | None) -> int:
        return self._client._call("receiver", "set_version", version, sig)

    def load_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._client._call("receiver", "load_disk", body)

    def max_bytes(self) -> int:
        if self._max_bytes is None:  # the model's shapes never change
            self._max_bytes = self._client._call("receiver", "max_bytes")
        return self._max_bytes

    def close(self) -> None:
        """Nothing here: the core removes its own files when it ends."""


if __name__ == "__main__":
    core_main()
