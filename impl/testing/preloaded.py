"""Python programs started from a process that has imported vLLM already: the test suite starts some 90 engine
processes, and each spent about 6 s of CPU importing vLLM before its engine started.

``start()`` starts a server (``python -m kvoffload.impl.testing.preloaded SOCKET``) for this process and its
children: it imports vLLM once, then forks a process for each program a client asks it to run (``popen``, ``run``:
subprocess's calls, for what the tests use), on the client's stdin, stdout and stderr, in its working directory and
environment. The program runs as under ``python``: as ``__main__``, with its ``sys.argv``, its ``sys.path`` and fresh
random states, and ends as the interpreter ends (threads joined, exit functions run, modules torn down: the
Mooncake client leaves its pool); its exit status, a signal's included, comes back to the client. Where
``KVOFFLOAD_PRELOADED`` names no server, or the program needs what only a new interpreter has (another Python,
other ``PYTHON*`` or OpenMP settings), the calls are subprocess's own.
"""

from __future__ import annotations

import json
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import types
from typing import Any, Sequence

SOCKET = "KVOFFLOAD_PRELOADED"  # "<the server's pid>:<its socket>", for this process and its children
# read by the interpreter or OpenMP when they start: a program that sets them otherwise than the server had them
# needs an interpreter of its own (PYTHONPATH is applied to sys.path, as at start). The loader's LD_PRELOAD and
# LD_LIBRARY_PATH are not compared: vLLM sets them in its own process, for the processes it starts (tcmalloc and
# libgomp on CPU; cv2's libraries), so a test process that ran an engine passes them on.
AT_START = ("PYTHON", "OMP_", "KMP_", "MKL_", "MALLOC")
PRELOAD = ("torch", "transformers", "vllm", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine")


def serve(path: str) -> None:
    started = _at_start(os.environ)
    for module in PRELOAD:
        __import__(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # clients connect once it listens
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters are reaped by the kernel
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        program = json.loads(message)
        if program["argv"][0] != sys.executable or len(program["argv"]) < 2 or _at_start(program["env"]) != started:
            conn.send(json.dumps({"pid": None}).encode())
        elif os.fork() == 0:
            listener.close()
            _wait_for(conn, program, fds)
        conn.close()
        for fd in fds:
            os.close(fd)


def _at_start(env: Any) -> dict[str, str]:
    """The settings a new interpreter would read as it starts (``AT_START``)."""
    return {k: v for k, v in env.items() if k.startswith(AT_START) and k != "PYTHONPATH"}


def _wait_for(conn: socket.socket, program: dict[str, Any], fds: list[int]) -> None:
    """The waiter: forks the program, tells the client its pid, then its exit status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(program, fds)
    try:
        conn.send(json.dumps({"pid": pid}).encode())
        status = os.waitpid(pid, 0)[1]
        conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
    finally:
        os._exit(0)


def _run(program: dict[str, Any], fds: list[int]) -> None:
    """The program, as ``python *argv`` would run it; exits with its status."""
    os.setsid()  # its own process group, as a killed test's program must not take the server along
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(program["cwd"])
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ.clear()
    os.environ.update(program["env"])
    path = [p for p in sys.path[1:] if p not in pythonpath]
    path[0:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    random.seed()  # a new interpreter's states differ from the server's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    kind, target, *args = program["argv"][1:] if program["argv"][1] in ("-m", "-c") else ["", *program["argv"][1:]]
    code: Any = 0
    try:
        if kind == "-m":
            sys.argv, sys.path = [target, *args], [os.getcwd(), *path]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "-c":
            sys.argv, sys.path = ["-c", *args], ["", *path]
            sys.modules["__main__"] = main = types.ModuleType("__main__")
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            sys.argv, sys.path = [target, *args], [os.path.dirname(os.path.abspath(target)), *path]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as done:
        code = done.code
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.exit(code)  # the interpreter's own ending: threads joined, exit functions run, modules torn down


def start() -> subprocess.Popen[bytes]:
    """A server for this process and the programs it starts (``KVOFFLOAD_PRELOADED``): it serves once it has
    imported vLLM; meanwhile a call waits for it."""
    path = os.path.join(tempfile.mkdtemp(prefix="kvoffload-preloaded-"), "socket")  # (AF_UNIX: a short path)
    server = subprocess.Popen([sys.executable, "-m", __name__, path], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ[SOCKET] = f"{server.pid}:{path}"
    return server


class Process:
    """A program the server runs: subprocess.Popen's ``pid``, ``returncode``, ``poll``, ``wait``, ``kill``,
    ``terminate`` and ``stdin`` / ``stdout`` (text) where asked for with ``PIPE``."""

    def __init__(self, conn: socket.socket, pid: int, argv: Sequence[str], stdin: Any, stdout: Any) -> None:
        self.args, self.pid, self._conn = list(argv), pid, conn
        self.stdin, self.stdout = stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                self._ended()
            except BlockingIOError:
                self._conn.setblocking(True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        self._conn.settimeout(timeout)
        try:
            return self._ended()
        except TimeoutError:
            self._conn.settimeout(None)
            raise subprocess.TimeoutExpired(self.args, timeout or 0) from None

    def _ended(self) -> int:
        reply = self._conn.recv(4096)
        self._conn.close()
        code: int = json.loads(reply)["returncode"] if reply else -signal.SIGKILL  # (the waiter was killed)
        self.returncode = code
        return code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _connect() -> socket.socket | None:
    """A connection to this process's server, once it serves; None if there is none."""
    server = os.environ.get(SOCKET)
    if not server:
        return None
    pid, _, path = server.partition(":")
    deadline = time.monotonic() + 120  # the server may still be importing vLLM
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if time.monotonic() > deadline or not os.path.exists(f"/proc/{pid}"):  # (a server that died)
                return None
            time.sleep(0.1)


def popen(argv: Sequence[str], stdin: Any = None, stdout: Any = None, stderr: Any = None,
          env: dict[str, str] | None = None, cwd: Any = None, text: bool = False) -> Process | subprocess.Popen[Any]:
    """``subprocess.Popen(argv, ...)``, run by the server where it can be (pipes: stdin and stdout, text)."""
    env = dict(os.environ if env is None else env)
    served = stderr not in (subprocess.PIPE, subprocess.STDOUT) and (text or subprocess.PIPE not in (stdin, stdout))
    conn = _connect() if served else None
    process = _ask(conn, argv, env, cwd, (stdin, stdout, stderr)) if conn is not None else None
    if process is None:
        return subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd, text=text)
    return process


def _ask(conn: socket.socket, argv: Sequence[str], env: dict[str, str], cwd: Any,
         streams: tuple[Any, Any, Any]) -> Process | None:
    """The server runs the program, on ``streams``; None if it needs an interpreter of its own."""
    ours: list[Any] = [None, None, None]  # our ends of the pipes
    theirs: list[int] = []  # the program's stdin, stdout and stderr
    for i, stream in enumerate(streams):
        if stream is subprocess.PIPE:
            read, write = os.pipe()
            theirs.append(read if i == 0 else write)
            ours[i] = open(write if i == 0 else read, "w" if i == 0 else "r")
        elif stream is subprocess.DEVNULL:
            theirs.append(os.open(os.devnull, os.O_RDWR))
        else:  # a file, a descriptor, or ours (None)
            theirs.append(os.dup(i if stream is None else stream if isinstance(stream, int) else stream.fileno()))
    program = {"argv": list(argv), "env": env, "cwd": os.path.abspath(cwd or os.getcwd())}
    try:
        socket.send_fds(conn, [json.dumps(program).encode()], theirs)
        pid = json.loads(conn.recv(4096))["pid"]
    finally:
        for fd in theirs:
            os.close(fd)
    if pid is None:
        conn.close()
        for end in ours:
            if end is not None:
                end.close()
        return None
    return Process(conn, pid, argv, ours[0], ours[1])


def run(argv: Sequence[str], capture_output: bool = False, text: bool = False, timeout: float | None = None,
        env: dict[str, str] | None = None, cwd: Any = None, stdout: Any = None) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(argv, ...)``, run by the server where it can be: what it printed, when captured, comes
    back through files (no pipe to keep drained)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        captured = capture_output or stdout is subprocess.PIPE
        process = popen(argv, stdin=subprocess.DEVNULL, stdout=out if captured else stdout,
                        stderr=err if capture_output else None, env=env, cwd=cwd)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise

        def read(file: Any) -> Any:
            file.seek(0)
            data = file.read()
            return data.decode(errors="replace") if text else data
        return subprocess.CompletedProcess(list(argv), code, read(out) if captured else None,
                                           read(err) if capture_output else None)


if __name__ == "__main__":
    serve(sys.argv[1])
