"""Real ``redis-server`` processes on loopback ports, for the Redis tier's tests and benchmark: one server with an ACL
user and a password (the default user off), or a Redis Cluster of several; each can be killed, frozen and restarted
on its port, as an operator's server would be."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

USER, PASSWORD = "kvoffload", "kv-test-secret"
ALL = "~* &* +@all"  # the test user's rights unless a test narrows them


def make_certificates(directory: Path) -> None:
    """A CA, and a certificate it signed for 127.0.0.1: ca.crt, server.crt, server.key (openssl)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=kvoffload-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj",
            "/CN=127.0.0.1")
    (directory / "san").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "server.crt", "-days", "2", "-extfile", "san")


def missing() -> str | None:
    """Why no server can run here, or None."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (`make redis` installs Debian's redis-server)"
    return None


def free_port(below: int = 65536) -> int:
    """A loopback port nothing listens on, under ``below``."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port < below:
            return port


class RedisServer:
    """One server on 127.0.0.1, no persistence unless ``persist`` (then an append-only file in its directory); with
    ``tls``, TLS only, its certificate signed by ``ca`` (a file in its directory); ``acl``: its user's rights."""

    def __init__(self, maxmemory: int = 0, persist: bool = False, cluster: bool = False, port: int = 0,
                 directory: Path | None = None, tls: bool = False, acl: str = ALL) -> None:
        self.port = port or free_port(below=55536 if cluster else 65536)  # a node's bus port is its port + 10000
        self.dir = directory or Path(tempfile.mkdtemp(prefix="kvoffload-redis-"))
        self.cluster, self.tls, self.ca = cluster, tls, self.dir / "ca.crt"
        lines = ["bind 127.0.0.1", f"dir {self.dir}", 'save ""', f"appendonly {'yes' if persist else 'no'}",
                 "appendfsync always", "user default off", f"user {USER} on >{PASSWORD} {acl}", "protected-mode no"]
        if tls:
            make_certificates(self.dir)
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {self.dir / 'server.crt'}",
                      f"tls-key-file {self.dir / 'server.key'}", f"tls-ca-cert-file {self.ca}", "tls-auth-clients no"]
        else:
            lines += [f"port {self.port}"]
        if maxmemory:
            lines += [f"maxmemory {maxmemory}", "maxmemory-policy allkeys-lru"]
        if cluster:
            lines += ["cluster-enabled yes", f"cluster-config-file nodes-{self.port}.conf", f"masteruser {USER}",
                      f"masterauth {PASSWORD}"]
        self.conf = self.dir / f"redis-{self.port}.conf"
        self.conf.write_text("\n".join(lines) + "\n")
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain client of the test user's."""
        return redis.Redis.from_url(self.url, username=USER, password=PASSWORD, socket_timeout=5,
                                    **({"ssl_ca_certs": str(self.ca)} if self.tls else {}))

    def start(self) -> None:
        log = open(self.dir / f"redis-{self.port}.log", "ab")
        self.process = subprocess.Popen(["redis-server", str(self.conf)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: see {log.name}") from None
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, its memory with it."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def freeze(self) -> None:
        """SIGSTOP: the server holds its connections and answers nothing."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.thaw()
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if not self.cluster:
            shutil.rmtree(self.dir, ignore_errors=True)


class RedisCluster:
    """``n`` masters (no replicas) on loopback ports, their slots assigned by ``redis-cli --cluster create``."""

    def __init__(self, n: int = 3) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvoffload-redis-cluster-"))
        self.nodes: list[RedisServer] = []
        try:
            self.nodes += [RedisServer(cluster=True, directory=self.dir) for _ in range(n)]
            subprocess.run(["redis-cli", "--user", USER, "--cluster", "create",
                            *(f"127.0.0.1:{node.port}" for node in self.nodes), "--cluster-yes"],
                           check=True, capture_output=True, env={**os.environ, "REDISCLI_AUTH": PASSWORD}, timeout=60)
            deadline = time.monotonic() + 20
            while not all(node.client().cluster("info")["cluster_state"] == "ok" for node in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not reach cluster_state:ok")
                time.sleep(0.1)
        except BaseException:
            self.__exit__()
            raise

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
