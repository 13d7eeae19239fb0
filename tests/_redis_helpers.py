"""A real ``redis-server`` for the tests: started on a free loopback port in a temporary
directory, stopped (or killed, and started again on the same port) by the test.

Without the binary the tests skip with how to install it; ``.ci/run`` installs it, and
with ``KV_TIERING_REQUIRE_REDIS=1`` (as in CI) a missing binary fails instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

if os.environ.get("KV_TIERING_REQUIRE_REDIS") == "1":
    import redis  # noqa: F401  # CI: a missing redis-py is a failure
else:
    pytest.importorskip("redis", reason="pip install 'kv-tiering[redis]'")

SERVER = shutil.which("redis-server")
_START_S = 10.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process; ``url`` stays the same across restarts."""

    def __init__(self, directory: Path, *args: str) -> None:
        if SERVER is None:
            message = "redis-server is not installed (apt-get install redis-server)"
            if os.environ.get("KV_TIERING_REQUIRE_REDIS") == "1":
                pytest.fail(message)
            pytest.skip(message)
        self.directory = directory
        self.port = _free_port()
        self.args = args
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
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
                    if sock.recv(64):  # +PONG, or -NOAUTH with requirepass: it is up
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def kill(self) -> None:
        """Stop it at once (SIGKILL), as a crashed server."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def stop(self) -> None:
        if self._process is not None:
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
