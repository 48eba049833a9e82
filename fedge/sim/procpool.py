"""``[simulation] backend = "process"``: worker processes on this machine, one :class:`DeviceHost` each.

A worker is a fresh interpreter (``python -m fedge.sim.procpool``) rather than a fork — forking a
process that already runs torch's thread pools can deadlock the child — and rather than
multiprocessing's ``spawn``, which re-imports the parent's main script in every child (a script
without an ``if __name__ == "__main__"`` guard would run again). The driver talks to each worker
over its stdin and a private copy of its stdout (the worker's own stdout goes to stderr, so a stray
``print`` cannot corrupt the stream), one length-prefixed frame per message. Every message is a
pickle made with the standard pickler (torch's multiprocessing reducers would otherwise move
tensors through shared-memory file descriptors). A worker that dies — killed, out of memory, a
crash in native code — closes its end of the pipe; the driver waits on every worker's pipe at
once, so a death ends that worker's part of the round at once and its devices are reported as
dropouts instead of the round hanging.
"""

from __future__ import annotations

import logging
import os
import pickle
import selectors
import subprocess
import sys
import time
import traceback
from typing import IO, Any

from fedge.edge.data.datasets import Dataset
from fedge.errors import FedgeError
from fedge.sim.pool import WorkerLost, WorkerPool, dumps
from fedge.sim.worker import DeviceHost, HostSpec

log = logging.getLogger(__name__)

_LEN = 8  # bytes of a frame's length prefix


def write_frame(out: IO[bytes], data: bytes) -> None:
    out.write(len(data).to_bytes(_LEN, "little"))
    out.write(data)
    out.flush()


def read_frame(inp: IO[bytes]) -> bytes:
    """One frame; :class:`EOFError` when the other side closed the pipe (also mid-frame)."""
    head = inp.read(_LEN)
    if len(head) < _LEN:
        raise EOFError("pipe closed")
    n = int.from_bytes(head, "little")
    data = inp.read(n)
    if len(data) < n:
        raise EOFError("pipe closed mid-frame")
    return data


def serve(inp: IO[bytes], out: IO[bytes]) -> None:
    """A worker's loop: build the host, then answer (method, args) calls until ``close`` or EOF."""
    host: DeviceHost | None = None
    while True:
        try:
            name, args = pickle.loads(read_frame(inp))
        except EOFError:  # the driver is gone
            return
        if name == "close":
            return
        try:
            if name == "start":
                sys.path[:] = args[0]  # the driver's: a method defined in a script's folder imports here too
                host = DeviceHost(*args[1:])
                result: Any = None
            else:
                assert host is not None, "start must come first"
                result = getattr(host, name)(*args)
            reply = ("ok", result)
        except BaseException as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        try:
            data = dumps(reply)
        except Exception as exc:  # a result that does not pickle is the worker's failure, not a silent loss
            data = dumps(("error", f"could not send the result of {name}: {type(exc).__name__}: {exc}"))
        write_frame(out, data)


def main() -> None:
    """``python -m fedge.sim.procpool``: a worker on stdin and a private copy of stdout."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # print() and C libraries writing to fd 1 end up on stderr, never in the protocol
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(sys.stdin.buffer, out)


class ProcessPool(WorkerPool):
    """``workers`` worker processes, each hosting the devices pinned to it."""

    kind = "process"

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self.start_seconds = 0.0

    def spawn(self, workers: int) -> None:
        """Start worker processes 0 … ``workers - 1``; each imports torch and fedge meanwhile."""
        for w in range(workers):
            if w in self._procs:
                continue
            # A session of its own: Ctrl-C in the terminal interrupts the driver alone, which then closes
            # the workers in order (instead of every worker dying mid-round with a traceback). As with
            # Ray's daemonised workers, Linux's autogroup scheduler then gives each worker its own share
            # of the CPUs rather than one share for the whole terminal session.
            self._procs[w] = subprocess.Popen(
                [sys.executable, "-m", "fedge.sim.procpool"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}, start_new_session=True)

    def start(self, specs: list[HostSpec], global_test: Dataset | None) -> dict[int, Any | WorkerLost]:
        t0 = time.perf_counter()
        self.spawn(max(s.worker for s in specs) + 1)  # any not spawned before
        for spec in specs:
            self._send(spec.worker, dumps(("start", (list(sys.path), spec, global_test))))
        out = self._gather(set(self._procs))
        self.start_seconds = time.perf_counter() - t0
        return out

    @property
    def live(self) -> list[int]:
        return sorted(self._procs)

    def pid(self, worker: int) -> int | None:
        """The process id of ``worker`` (None: not running)."""
        proc = self._procs.get(worker)
        return proc.pid if proc is not None else None

    def broadcast(self, name: str, *args: Any) -> dict[int, Any | WorkerLost]:
        data = dumps((name, args))  # once, whatever the worker count
        targets = set(self._procs)
        for w in sorted(targets):
            self._send(w, data)
        return self._gather(targets)

    def call_each(self, name: str, args: dict[int, tuple[Any, ...]]) -> dict[int, Any | WorkerLost]:
        targets = {w for w in args if w in self._procs}
        for w in sorted(targets):
            self._send(w, dumps((name, args[w])))
        out = self._gather(targets)
        out.update({w: WorkerLost(w, f"worker {w} was lost before") for w in args if w not in targets})
        return out

    def _send(self, worker: int, data: bytes) -> None:
        stdin = self._procs[worker].stdin
        assert stdin is not None
        try:
            write_frame(stdin, data)
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            log.warning("worker %d: could not send to it (%s); it is treated as lost", worker, exc)

    def _gather(self, targets: set[int]) -> dict[int, Any | WorkerLost]:
        """Each target's reply, or :class:`WorkerLost` for a worker that died before answering."""
        out: dict[int, Any | WorkerLost] = {}
        with selectors.DefaultSelector() as sel:
            for w in targets:
                stdout = self._procs[w].stdout
                assert stdout is not None
                sel.register(stdout, selectors.EVENT_READ, w)
            error: str | None = None
            while len(out) < len(targets):
                for key, _ in sel.select():
                    w = key.data
                    sel.unregister(key.fileobj)
                    try:
                        status, value = pickle.loads(read_frame(key.fileobj))  # type: ignore[arg-type]
                    except EOFError:
                        out[w] = self._lost(w)
                        continue
                    out[w] = value
                    if status == "error" and error is None:
                        error = f"worker {w} failed: {value}"
            if error is not None:  # after every reply is in, so no worker is left mid-message
                raise FedgeError(error)
        return out

    def _lost(self, worker: int) -> WorkerLost:
        proc = self._procs.pop(worker)
        try:
            code = proc.wait(10.0)
        except subprocess.TimeoutExpired:  # its pipe closed but it lingers: end it
            proc.kill()
            code = proc.wait()
        reason = (f"worker {worker} (pid {proc.pid}) died: "
                  + (f"killed by signal {-code}" if code < 0 else f"exit code {code}"))
        log.warning("%s", reason)
        return WorkerLost(worker, reason)

    def close(self) -> None:
        for proc in self._procs.values():
            try:
                assert proc.stdin is not None
                write_frame(proc.stdin, dumps(("close", ())))
                proc.stdin.close()
            except OSError:
                pass
        for w, proc in list(self._procs.items()):
            try:
                proc.wait(10.0)
            except subprocess.TimeoutExpired:
                log.warning("worker %d (pid %d) did not stop within 10 s; killing it", w, proc.pid)
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self._procs.clear()


if __name__ == "__main__":
    main()
