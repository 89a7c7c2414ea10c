"""The engine core in a process of its own (vLLM V1's ``EngineCoreProc``).

``kvpilot serve`` starts it (``engine.core_client.MPClient``): this process loads the
``LLMEngine`` and then runs a busy loop of its own, so that the API process's HTTP, SSE,
JSON and tokenization never hold the interpreter lock that the step loop needs, and the next
step starts as soon as the last one's outputs are sent, without waiting for the API to read
them. Between steps it takes the API's calls from its pipe, in order (add a request, abort,
adapters, KV events, health); a structured-output grammar compiles on a thread beside the
steps. After every step it sends the outputs as deltas (``engine.output_delta``) with the
engine's stats.

Messages, each one pickled object over one ``multiprocessing`` pipe:

- API to core: ``("call", call_id, name, args)`` for a call of ``engine_core.CALLS``;
  ``("shutdown",)``.
- Core to API: ``("ready", EngineCoreInfo)`` or ``("load_failed", exception)`` once;
  ``("reply", call_id, ok, value_or_exception)``; ``("outputs", deltas, stats)`` after each
  step; ``("step_failed", exception, stats)`` after a step raised (every unfinished request is
  aborted first, and the loop goes on serving new ones).

The process ends when the API asks it to, or when its pipe closes (the API process died).
"""

from __future__ import annotations

import concurrent.futures
import logging
import logging.config
import multiprocessing.connection
import pickle
import signal
import threading
from typing import Any

from kvpilot.engine import engine_core
from kvpilot.engine.output_delta import OutputDeltaEncoder
from kvpilot.engine.startup_heap import freeze_startup_heap

logger = logging.getLogger("kvpilot.engine")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def run_engine_core(
    engine_args: Any,
    conn: multiprocessing.connection.Connection,
    log_config: dict[str, Any] | None = None,
) -> None:
    """The engine-core process's main: set up logging (``log_config``, the server's
    ``--log-config-file``, else INFO to stderr), load the engine from ``engine_args`` (an
    ``EngineArgs``), report ``ready`` or ``load_failed`` on ``conn``, then serve until told
    to stop or the pipe closes."""
    # Ctrl-C reaches the whole process group; the API process decides when this one stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_config is None:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    else:  # the API process checked it before starting this one
        logging.config.dictConfig(log_config)
    try:
        from kvpilot.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(engine_args)
        info = engine_core.EngineCoreInfo.from_engine(engine)
        freeze_startup_heap()
    except BaseException as exc:  # noqa: BLE001 - reported to the API, which stops
        _send_quietly(conn, ("load_failed", picklable(exc)))
        return
    if _send_quietly(conn, ("ready", info)):
        EngineCoreProc(engine, conn).run()
    else:
        engine.shutdown()


class EngineCoreProc:
    """Serves one loaded ``LLMEngine`` over ``conn`` (see the module docstring)."""

    def __init__(self, engine: Any, conn: multiprocessing.connection.Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.encoder = OutputDeltaEncoder()
        # The concurrent calls reply from their own thread.
        self._send_lock = threading.Lock()
        self._threads = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="core-call")

    def run(self) -> None:
        """Step while requests are unfinished, take calls between steps, wait for calls when
        idle; return when told to stop or when the pipe closes."""
        try:
            while self._take_calls(wait=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
        finally:
            self._threads.shutdown(wait=False, cancel_futures=True)
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("shutting the engine down failed")

    def _take_calls(self, wait: bool) -> bool:
        """Run every call waiting on the pipe (the first one awaited when ``wait``); False
        when the process should end."""
        timeout = None if wait else 0
        while self.conn.poll(timeout):
            try:
                message = self.conn.recv()
            except EOFError:
                return False
            if message[0] == "shutdown":
                return False
            _, call_id, name, args = message
            if name in engine_core.CONCURRENT_CALLS:
                self._threads.submit(self._call, call_id, name, args)
            else:
                self._call(call_id, name, args)
            timeout = 0
        return True

    def _call(self, call_id: int, name: str, args: tuple[Any, ...]) -> None:
        try:
            reply = ("reply", call_id, True, engine_core.CALLS[name](self.engine, *args))
        except Exception as exc:
            reply = ("reply", call_id, False, picklable(exc))
        if name == "abort":
            self.encoder.forget(args[0])
        try:
            self._send(reply)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # an unpicklable value
            self._send(("reply", call_id, False, RuntimeError(f"{name}: {exc}")))

    def _step(self) -> None:
        try:
            outputs, stats = engine_core.step(self.engine)
        except Exception as exc:
            logger.exception("engine step failed; aborting every unfinished request")
            try:
                self.encoder.forget(engine_core.abort_all(self.engine))
                stats = self.engine.get_stats()
            except Exception:
                logger.exception("aborting the failed requests failed too")
                stats = None
            self._send(("step_failed", picklable(exc), stats))
            return
        self._send(("outputs", self.encoder.encode(outputs), stats))

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            _send_quietly(self.conn, message)


def _send_quietly(conn: multiprocessing.connection.Connection, message: tuple[Any, ...]) -> bool:
    """Send; False on a closed pipe (the API process is gone; the loop ends at its next read)."""
    try:
        conn.send(message)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return False
    return True


def picklable(exc: BaseException) -> BaseException:
    """``exc`` itself when it survives pickling, else a ``RuntimeError`` naming its type and
    message (an exception type with required constructor arguments does not)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
