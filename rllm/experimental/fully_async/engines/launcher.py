"""Start N inference-engine servers as subprocesses on free ports, wait until they are healthy, stop them.

The launcher does not know which engine it starts: an `EngineCommand` builds the command line (the embedded
engine here, SGLang in `sglang.py`), so the rollout side gets the same list of URLs either way.

Processes never outlive their owner: each engine runs in its own session (process group), `stop()` sends
SIGTERM to the group, waits, then SIGKILLs it; a failed start stops the engines already started; the context
manager and an `atexit` hook call `stop()` too; with `die_with_parent` the kernel kills them when the launching process
dies without stopping them. Engine output goes to one log file per engine, whose tail is put
into the error when an engine dies or does not become healthy in time.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import httpx

from rllm.experimental.fully_async.engines.lora import lora_flags
from rllm.experimental.fully_async.errors import FullyAsyncError

if TYPE_CHECKING:  # run_spec imports verl (~4 s) through algorithms/; an engine process needs only the type
    from rllm.experimental.fully_async.run_spec import EngineLoRASpec

logger = logging.getLogger(__name__)

# The directory that contains the `rllm` package, so `python -m rllm...` works in the child from any cwd.
_PROJECT_ROOT = str(Path(__file__).resolve().parents[4])
_BIND_RETRIES = 3  # a free port can be taken by someone else between probing and binding
# Run before the engine's own command (same pid, through exec): the kernel SIGKILLs the engine when the process that
# started it dies (prctl PR_SET_PDEATHSIG, kept across exec), and it exits at once if that process is already gone.
# A shim rather than Popen's preexec_fn, which may deadlock in a process with threads (a Ray worker has many).
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execvp(sys.argv[2], sys.argv[2:])"
)


class EngineStartupError(FullyAsyncError, RuntimeError):
    """An engine exited or did not answer /health in time; the message carries its log tail."""


class EngineCommand(Protocol):
    """How to start engine number `index` listening on host:port."""

    def build(self, host: str, port: int, index: int) -> list[str]: ...

    def env(self, index: int) -> dict[str, str]: ...


@dataclass(frozen=True)
class EmbeddedEngineCommand:
    """Command line of the embedded CPU engine (`engines/embedded/server.py`)."""

    model_path: str
    max_running_requests: int = 256
    max_prefill_tokens: int = 16384
    dtype: str = "float32"
    seed: int = 0  # engine i samples with seed + i, so replicas do not draw identical streams
    weight_version: str = "0"
    num_threads: int = 0  # torch threads per engine; 0 = torch default. On a small CPU, cores / engines.
    log_level: str = "INFO"
    # --enable-deterministic-inference: seeded draws, one request at a time (engines/embedded/scheduler.py)
    deterministic_inference: bool = False
    lora: EngineLoRASpec | None = None  # LoRA adapters served: SGLang's LoRA flags (engines/lora.py)
    # --forward-sleep-time: seconds slept before every forward pass (SGLang's /slow_down, from the start); 0 = off
    forward_sleep_s: float = 0.0
    extra_args: tuple[str, ...] = ()
    python: str = sys.executable

    def build(self, host: str, port: int, index: int) -> list[str]:
        deterministic = ["--enable-deterministic-inference"] if self.deterministic_inference else []
        slowed = ["--forward-sleep-time", repr(float(self.forward_sleep_s))] if self.forward_sleep_s > 0 else []
        return [
            self.python,
            "-m",
            "rllm.experimental.fully_async.engines.embedded.server",
            "--model-path",
            str(self.model_path),
            "--host",
            host,
            "--port",
            str(port),
            "--max-running-requests",
            str(self.max_running_requests),
            "--max-prefill-tokens",
            str(self.max_prefill_tokens),
            "--dtype",
            self.dtype,
            "--seed",
            str(self.seed + index),
            "--weight-version",
            str(self.weight_version),
            "--num-threads",
            str(self.num_threads),
            "--log-level",
            self.log_level,
            *deterministic,
            *lora_flags(self.lora, sglang=False),
            *slowed,
            *self.extra_args,
        ]

    def env(self, index: int) -> dict[str, str]:
        return {}


@dataclass(frozen=True)
class PlacedEngineCommand:
    """Another command's engines at given indices and GPUs: local engine i is engine `slots[i][0]` of the run (its
    seed and name) and sees the GPUs `slots[i][1]` (`CUDA_VISIBLE_DEVICES`, from the placement plan; "" = none).

    An engine host on one node of a cluster launches only that node's engines with an `EngineLauncher` of this.
    """

    inner: EngineCommand
    slots: tuple[tuple[int, str], ...]  # (run-wide engine index, CUDA_VISIBLE_DEVICES)

    def build(self, host: str, port: int, index: int) -> list[str]:
        return self.inner.build(host, port, self.slots[index][0])

    def env(self, index: int) -> dict[str, str]:
        engine, devices = self.slots[index]
        return {**self.inner.env(engine), "CUDA_VISIBLE_DEVICES": devices}


@dataclass
class EngineProcess:
    """One started engine."""

    index: int
    host: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    command: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def log_tail(self, max_chars: int = 3000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return text[-max_chars:]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on `host` a moment ago (the engine may still lose a race for it; we retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EngineLauncher:
    """Start `num_engines` engines, wait for /health, and stop them without leaving processes behind.

    Use as a context manager (`with EngineLauncher(cmd, 2) as engines: engines.urls`) or call `start()` and
    `stop()` yourself.
    """

    def __init__(
        self,
        command: EngineCommand,
        num_engines: int = 1,
        *,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 120.0,
        stop_timeout_s: float = 10.0,
        log_dir: str | Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        """`die_with_parent` (Linux): the engines are killed when this process dies, even by SIGKILL, where no
        `stop()` can run (an engine host actor on a cluster node whose owner died)."""
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.command = command
        self.num_engines = num_engines
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="rllm-engines-"))
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self.processes: list[EngineProcess] = []
        # The secret engines require (`--api-key`, set by engines.from_config beyond loopback); None: no key.
        self.api_key: str | None = None
        self._spawns: dict[int, int] = {}  # starts per engine index (port-race retries)
        self._spawned: list[subprocess.Popen[bytes]] = []  # every process started and not yet stopped
        self.released: set[int] = set()  # slots whose engine left the run (`release`): stopped, never restarted

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.processes]

    def __enter__(self) -> EngineLauncher:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, *, wait: bool = True) -> list[str]:
        """Start every engine and wait until all are healthy; returns their URLs. Stops all of them on failure.
        `wait=False` only spawns them (an engine added during a run on a cluster node: the supervisor probes it)."""
        if self.processes:
            raise RuntimeError("engines already started; stop() them first")
        self._spawns = {}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        try:
            for i in range(self.num_engines):  # one by one: an interrupt between spawns still stops the first
                self.processes.append(self._spawn(i))
            if wait:
                self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        logger.info("started %d engine(s): %s", len(self.processes), ", ".join(self.urls))
        return self.urls

    def stop(self) -> None:
        """Stop every engine: SIGTERM to its process group, then SIGKILL after `stop_timeout_s`."""
        processes, self.processes = [p for i, p in enumerate(self.processes) if i not in self.released], []
        for proc in processes:
            _signal_group(proc.process, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for proc in processes:
            try:
                proc.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("engine %s (pid %d) ignored SIGTERM; killing its process group", proc.url, proc.pid)
            # Also reap anything the engine left in its group (e.g. workers), even after a clean exit.
            _signal_group(proc.process, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.process.wait(timeout=self.stop_timeout_s)
        # A process started but not yet listed (start interrupted right after its spawn), or a replaced one.
        spawned, self._spawned = self._spawned, []
        for process in spawned:
            if process.poll() is None:  # an exited, reaped one's group id may belong to someone else by now
                _signal_group(process, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=self.stop_timeout_s)
        atexit.unregister(self.stop)

    def restart(self, index: int) -> EngineProcess:
        """Start a new process for engine slot `index` (whose process died) on a new port, without waiting.

        The dead process is reaped and replaced in `processes` at once, so `stop()` covers the new one; call
        `probe(index)` until it is healthy. The engine starts from the launch command's weights and version: the
        caller loads the current ones.
        """
        old = self.processes[index]
        if old.alive():
            raise RuntimeError(f"engine {index} ({old.url}, pid {old.pid}) is still running; not restarting it")
        self._spawns[index] = 0  # the port-race retries count per start
        self.processes[index] = self._spawn(index)
        return self.processes[index]

    def add(self) -> EngineProcess:
        """Start one more engine, in a new slot (the next index: its own seed and log), without waiting; call
        `probe(index)` until it is healthy (the supervisor does). `stop()` covers it from now on."""
        if not self.processes:
            raise RuntimeError("engines not started; start() them first")
        index = len(self.processes)
        self._spawns[index] = 0
        self.processes.append(self._spawn(index))
        return self.processes[index]

    def release(self, index: int) -> None:
        """Stop slot `index`'s engine for good (it left the run): SIGTERM to its group, SIGKILL after
        `stop_timeout_s`. The slot keeps its place, so indices stay the slots' names."""
        proc = self.processes[index]
        self.released.add(index)
        if proc.process.poll() is None:
            _signal_group(proc.process, signal.SIGTERM)
            try:
                proc.process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("engine %s (pid %d) ignored SIGTERM; killing its process group", proc.url, proc.pid)
            _signal_group(proc.process, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.process.wait(timeout=self.stop_timeout_s)
        with contextlib.suppress(ValueError):
            self._spawned.remove(proc.process)
        logger.info("engine %d (%s) released", index, proc.url)

    def probe(self, index: int, *, timeout_s: float = 2.0) -> bool:
        """One health check of engine slot `index`: True once /health answers 200, False while it is starting.

        Raises EngineStartupError when the process exited (after retrying a lost port race on a new port).
        """
        proc = self.processes[index]
        if not proc.alive():
            self.processes[index] = self._respawn_after_exit(proc)
            return False
        try:
            with httpx.Client(timeout=httpx.Timeout(timeout_s)) as http:
                return http.get(f"{proc.url}/health").status_code == 200
        except httpx.TransportError:
            return False  # not listening yet

    def kill(self, index: int) -> None:
        """SIGKILL engine slot `index` and its process group (an engine that hangs in start-up), and reap it."""
        proc = self.processes[index]
        _signal_group(proc.process, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.process.wait(timeout=self.stop_timeout_s)

    def _spawn(self, index: int) -> EngineProcess:
        self._spawns[index] = self._spawns.get(index, 0) + 1
        port = free_port(self.host)
        cmd = self.command.build(self.host, port, index)
        env = {**os.environ, **self.command.env(index)}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, env.get("PYTHONPATH", "")) if p)
        log_path = self.log_dir / f"engine-{index}-{port}.log"
        argv = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd] if self.die_with_parent else cmd
        with open(log_path, "wb") as log, interrupts_deferred():
            # start_new_session: the engine leads its own process group, so stop() can kill all it spawned.
            process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
            self._spawned.append(process)  # before any interrupt can land: stop() reaps it even if never listed
        logger.info("engine %d: pid %d on %s:%d (log %s)", index, process.pid, self.host, port, log_path)
        return EngineProcess(index, self.host, port, process, log_path, cmd)

    def _wait_healthy(self) -> None:
        """Poll /health of every engine until all answer 200, one exits, or the startup timeout passes."""
        deadline = time.monotonic() + self.startup_timeout_s
        pending = set(range(len(self.processes)))
        with httpx.Client(timeout=httpx.Timeout(2.0)) as http:
            while pending:
                for i in sorted(pending):
                    proc = self.processes[i]
                    if not proc.alive():
                        self.processes[i] = self._respawn_after_exit(proc)
                        continue
                    try:
                        if http.get(f"{proc.url}/health").status_code == 200:
                            pending.discard(i)
                    except httpx.TransportError:
                        pass  # not listening yet
                if not pending:
                    break
                if time.monotonic() > deadline:
                    stuck = [self.processes[i] for i in sorted(pending)]
                    details = "; ".join(f"{p.url} (pid {p.pid}) log tail:\n{p.log_tail()}" for p in stuck)
                    raise EngineStartupError(
                        f"timed out after {self.startup_timeout_s:.0f}s waiting for /health of {len(pending)} "
                        f"engine(s): {details}"
                    )
                # A readiness probe of another process: there is no event to wait on, so poll gently.
                time.sleep(0.2)

    def _respawn_after_exit(self, proc: EngineProcess) -> EngineProcess:
        tail = proc.log_tail()
        lost_port_race = "address already in use" in tail.lower() or f"[errno {errno.EADDRINUSE}]" in tail.lower()
        if lost_port_race and self._spawns.get(proc.index, 0) <= _BIND_RETRIES:
            logger.warning("engine %d lost port %d to another process; retrying on a new port", proc.index, proc.port)
            return self._spawn(proc.index)
        raise EngineStartupError(
            f"engine {proc.index} ({proc.url}, pid {proc.pid}) exited with code {proc.process.returncode} before "
            f"becoming healthy; command: {' '.join(proc.command)}\nlog tail:\n{tail}"
        )


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver them to the handlers in place before it.

    Between Popen's fork and its return the child exists but nobody holds its handle: an interrupt raised there
    would leave an engine running in its own session (measured: a SIGTERM as an engine starts left it behind).
    Handlers are Python's, so the child (after exec) starts with the default ones.
    """
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in sigs}
    if threading.current_thread() is not threading.main_thread() or None in previous.values():
        yield  # signals reach only the main thread; a handler installed from C cannot be put back
        return
    caught: list[int] = []
    for sig in sigs:
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the process group led by `process` (ignoring groups that are already gone)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)
