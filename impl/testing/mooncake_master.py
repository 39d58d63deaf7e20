"""A real ``mooncake_master`` on loopback ports (its RPC port, its HTTP metadata server, its metrics port), for the
Mooncake tier's tests: started, killed, frozen and restarted as an operator's master would be."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .redis_server import free_port


def binary(name: str = "mooncake_master") -> str | None:
    """A program that ``pip install kvoffload[mooncake]`` installs beside the Python that runs us, or on PATH."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


def missing() -> str | None:
    """Why no master or client can run here, or None."""
    if binary() is None:
        return "mooncake_master is not installed (`make install` installs kvoffload[mooncake])"
    try:
        import mooncake.store  # noqa: F401  (its client needs Debian's libibverbs1, even over TCP)
    except ImportError as error:
        return f"the Mooncake store client cannot be imported ({error}; `make mooncake` installs libibverbs1)"
    return None


class MooncakeMaster:
    """One master on 127.0.0.1 with its HTTP metadata server, and the store nodes that lend the pool their memory
    (``mooncake_client`` processes: records outlive the engines that put them); ``lease_ms``: how long a read object
    may not be removed (the master's ``default_kv_lease_ttl``)."""

    def __init__(self, lease_ms: int = 5000, node_bytes: int = 256 << 20) -> None:
        self.port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.lease_ms, self.node_bytes = lease_ms, node_bytes
        self.dir = Path(tempfile.mkdtemp(prefix="kvoffload-mooncake-"))
        self.process: subprocess.Popen[bytes] | None = None
        self.nodes: list[subprocess.Popen[bytes]] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def settings(self, **options: object) -> dict[str, object]:
        """The ``shared_tier`` entry that reaches this master."""
        return {"backend": "mooncake", "master": self.address, "metadata": self.metadata, **options}

    def start(self) -> MooncakeMaster:
        command = [str(binary()), f"--rpc_port={self.port}", "--enable_http_metadata_server=true",
                   f"--http_metadata_server_port={self.http_port}", f"--metrics_port={self.metrics_port}",
                   f"--default_kv_lease_ttl={self.lease_ms}"]
        with open(self.dir / "master.log", "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        _wait(self.process, (self.port, self.http_port), self.dir / "master.log")
        return self

    def add_node(self) -> subprocess.Popen[bytes]:
        """A store node lending ``node_bytes`` of its memory to the pool (run as operators run them)."""
        port = free_port()
        command = [str(binary("mooncake_client")), f"--master_server_address={self.address}",
                   f"--metadata_server={self.metadata}", f"--global_segment_size={self.node_bytes}",
                   "--local_buffer_size=16777216", "--host=127.0.0.1", f"--port={port}"]
        with open(self.dir / f"node-{port}.log", "ab") as log:
            node = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        try:
            _wait(node, (port,), self.dir / f"node-{port}.log")
        except RuntimeError as error:
            _kill(node)
            alive = self.process is not None and self.process.poll() is None
            raise RuntimeError(f"{error}\nthe master ({'running' if alive else 'exited'}) logged last: "
                               f"{(self.dir / 'master.log').read_text()[-1000:]}") from None
        self.nodes.append(node)
        return node

    def kill(self) -> None:
        _kill(self.process)

    def kill_nodes(self) -> None:
        """Every store node dies, and the pool's memory with it (the master still names their objects)."""
        for node in self.nodes:
            _kill(node)
        self.nodes.clear()

    def freeze(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def __enter__(self) -> MooncakeMaster:
        tries = 3  # a port free when chosen may be another process's before the master binds it, and a node that
        while True:  # cannot join the master on its port goes on to others: then both start again, on new ports
            try:
                self.start()
                self.add_node()
                return self
            except RuntimeError:
                self._stop()
                tries -= 1
                if not tries:
                    raise
                self.port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()

    def __exit__(self, *exc: object) -> None:
        self._stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _stop(self) -> None:
        self.kill_nodes()
        self.kill()


def _wait(process: subprocess.Popen[bytes], ports: tuple[int, ...], log: Path) -> None:
    deadline = time.monotonic() + 20
    while not all(map(_listening, ports)):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{log.stem} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)


def _kill(process: subprocess.Popen[bytes] | None) -> None:
    if process is not None and process.poll() is None:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
