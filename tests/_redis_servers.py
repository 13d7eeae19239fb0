"""A local ``redis-server`` for the tests and the Redis benchmarks: started on a free
loopback port in a directory of the caller's, stopped (or killed, and started again on
the same port); a local Redis Cluster of such servers; and the benchmarks' way to
remove the keys they wrote, and only those, from any server (:func:`unlink_matching`).

A test aid, not product: it runs without persistence and binds to 127.0.0.1 only. It
imports nothing of the project or of pytest, so examples/bench_redis.py,
bench_redis_glide.py and bench_fleet.py load it from a checkout (with tests/ on
``sys.path``).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SERVER = shutil.which("redis-server")
"""The ``redis-server`` binary on the PATH, or None."""
_START_S = 10.0


_HANDED_OUT: set[int] = set()


def _free_port() -> int:
    """A loopback port free now and never handed out before by this process: ports are
    chosen before their servers start, and the kernel may offer a free port twice (two
    nodes of one cluster on one port: the second server exits, the first answers both)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class LocalRedisServer:
    """One ``redis-server`` process; ``url`` stays the same across restarts.

    Raises (constructor): FileNotFoundError if ``redis-server`` is not installed.
    """

    def __init__(
        self, directory: Path, *args: str, tls: tuple[Path, Path, Path] | None = None
    ) -> None:
        """``tls``: (certificate, key, CA certificate) files: the server then also
        listens with TLS on ``tls_port`` (``tls_url``), clients not asked for a
        certificate."""
        if SERVER is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.directory = directory
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.tls_port: int | None = None
        self.tls_url: str | None = None
        if tls is not None:
            self.tls_port = _free_port()
            self.tls_url = f"rediss://127.0.0.1:{self.tls_port}/0"
            cert, key, ca = tls
            args = (
                *args, "--tls-port", str(self.tls_port), "--tls-cert-file", str(cert),
                "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                "--tls-auth-clients", "no",
            )  # fmt: skip
        self.args = args
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it and wait until it answers.

        Raises:
            RuntimeError: it did not answer within 10 s, or exited while another server
                answered on its port.
        """
        self._process = subprocess.Popen(
            [SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory), *self.args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    answered = sock.recv(64)  # +PONG, or -NOAUTH with requirepass
                if answered and self._process.poll() is None:  # it is up, and it is ours
                    return
                if answered:
                    raise RuntimeError(f"redis-server exited; port {self.port} answers another")
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def pause(self) -> None:
        """Stop it answering (SIGSTOP), as a hung server: connections open, no replies.
        Call :meth:`resume` before stopping it."""
        if self._process is not None:
            self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused server answer again (SIGCONT)."""
        if self._process is not None:
            self._process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """Stop it at once (SIGKILL), as a crashed server."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 5 s), paused or not; idempotent."""
        if self._process is not None:
            self.resume()  # a paused process would not act on SIGTERM
            self._process.terminate()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def command(self, *args: str | bytes) -> object:
        """Run one command on the server with a plain synchronous client."""
        import redis

        with redis.Redis.from_url(self.url) as client:
            return client.execute_command(*args)


_UNLINK_BATCH = 512  # names per UNLINK


def unlink_matching(url: str, pattern: bytes, *, cluster: bool = False) -> int:
    """Delete (``UNLINK``) the keys of the server (with ``cluster``: the Redis Cluster)
    at ``url`` whose names match the glob ``pattern``, found with ``SCAN ... MATCH`` on
    the url's database (on every primary of a cluster), and no other key; returns how
    many went. A benchmark names every key it writes under a pattern of its own run, so
    it removes what it wrote and leaves the server's other data as it was. Raises
    redis-py's errors (the server unreachable, a refused command)."""
    import redis

    client = redis.RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    removed, batch = 0, []
    with client:
        for name in client.scan_iter(match=pattern, count=1000):
            batch.append(name)
            if len(batch) == _UNLINK_BATCH:
                removed += client.unlink(*batch)
                batch.clear()
        if batch:
            removed += client.unlink(*batch)
    return removed


_SLOTS = 16384  # a Redis Cluster's hash slots


class LocalRedisCluster:
    """A Redis Cluster of ``nodes`` local primaries (no replicas), each in a directory of
    its own under ``directory``, the slots split evenly between them; ``url`` names the
    first node (a cluster client finds the others from it).

    Raises (constructor): FileNotFoundError if ``redis-server`` is not installed.
    """

    def __init__(self, directory: Path, nodes: int = 3) -> None:
        self.nodes: list[LocalRedisServer] = []
        self.bus_ports: list[int] = []
        for index in range(nodes):
            node_dir = directory / f"node-{index}"
            node_dir.mkdir(parents=True, exist_ok=True)
            # The bus port is named: its default, the port + 10000, may be taken or
            # past 65535 for a port from the ephemeral range.
            self.bus_ports.append(_free_port())
            self.nodes.append(
                LocalRedisServer(
                    node_dir, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-port", str(self.bus_ports[-1]),
                )
            )  # fmt: skip
        self.url = self.nodes[0].url

    def start(self) -> None:
        """Start every node, give each its share of the slots, join them and wait until
        every node reports the cluster ok.

        Raises:
            RuntimeError: a node did not answer, or the cluster was not ok within 10 s.
        """
        for node in self.nodes:
            node.start()
        count = len(self.nodes)
        for index, node in enumerate(self.nodes):
            node.command("CLUSTER", "SET-CONFIG-EPOCH", str(index + 1))
            first, last = index * _SLOTS // count, (index + 1) * _SLOTS // count - 1
            node.command("CLUSTER", "ADDSLOTSRANGE", str(first), str(last))
        for node, bus_port in zip(self.nodes[1:], self.bus_ports[1:], strict=True):
            self.nodes[0].command("CLUSTER", "MEET", "127.0.0.1", str(node.port), str(bus_port))
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            if all(self._sees_everyone(node) for node in self.nodes):
                return
            time.sleep(0.05)
        raise RuntimeError("the local redis cluster did not come up")

    def _sees_everyone(self, node: LocalRedisServer) -> bool:
        info = node.command("CLUSTER", "INFO")
        known = node.command("CLUSTER", "NODES")
        assert isinstance(info, bytes) and isinstance(known, bytes)
        return b"cluster_state:ok" in info and len(known.splitlines()) == len(self.nodes)

    def stop(self) -> None:
        """Stop every node; idempotent."""
        for node in self.nodes:
            node.stop()
