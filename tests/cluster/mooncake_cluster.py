"""Test support: a real Mooncake Store on loopback (the wheel's mooncake_master, and a
mooncake_client process that holds the memory segment objects live in), on free ports, each
process's output in a file under TEST_TMPDIR, stopped by pid with escalation (SIGCONT, SIGTERM,
then SIGKILL: mooncake_client ignores SIGTERM for seconds, a segment holder can hang at exit).

    with MooncakeCluster() as cluster:
        store = kvt.cluster.ClusterStore(cluster.config())
        cluster.wait_ready(store)          # a holder's segment is mounted: puts can land
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any, List, Optional

from kvt.cluster import ClusterError, StoreConfig, loopback_environment


def mooncake_dir() -> str:
    """The installed wheel's package directory (mooncake_master and mooncake_client lie in it)."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the mooncake package (mooncake-transfer-engine-non-cuda) is not "
                           "installed in this Python (requirements.lock)")
    return list(spec.submodule_search_locations)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, log: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"exited ({process.returncode}) before listening on {port}:\n"
                               f"{read(log)}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout} s:\n{read(log)}")


def read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-20000:]
    except OSError:
        return ""


def stop(process: Optional[subprocess.Popen], grace: float = 2.0) -> None:
    """Stops one child by its pid: SIGCONT (in case a test stopped it), SIGTERM, then SIGKILL
    after `grace` seconds; always reaped."""
    if process is None or process.poll() is not None:
        return
    for sig, wait in ((signal.SIGCONT, 0.0), (signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.kill(process.pid, sig)
        except ProcessLookupError:
            break
        if wait:
            try:
                process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue
    process.wait()


class MooncakeCluster:
    """mooncake_master (HTTP metadata server included) and one mooncake_client segment holder
    of `segment_bytes`, on loopback."""

    def __init__(self, segment_bytes: int = 256 << 20, name: str = "mooncake") -> None:
        loopback_environment()
        self.dir = mooncake_dir()
        self.segment_bytes = segment_bytes
        root = os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
        self.logs = tempfile.mkdtemp(prefix=f"{name}-", dir=root)
        self.rpc_port = free_port()
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.holder_port = free_port()
        self.master: Optional[subprocess.Popen] = None
        self.holder: Optional[subprocess.Popen] = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def config(self, **overrides: Any) -> StoreConfig:
        """A pure client's configuration (no segment of its own)."""
        values = dict(master_server_address=self.master_address,
                      metadata_server=self.metadata_server, global_segment_size=0)
        values.update(overrides)
        return StoreConfig(**values)

    def _spawn(self, argv: List[str], log: str) -> subprocess.Popen:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        # SIGKILL when the test process dies without stopping it (a crash in the store client
        # would otherwise leave a master and a holder running): setpriv (util-linux) sets the
        # parent-death signal, then execs the binary, so the pid is the binary's.
        if os.path.exists("/usr/bin/setpriv"):
            argv = ["/usr/bin/setpriv", "--pdeathsig", "KILL", "--"] + argv
        with open(log, "wb") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)

    def start_master(self) -> None:
        log = os.path.join(self.logs, "master.log")
        self.master = self._spawn([
            os.path.join(self.dir, "mooncake_master"), f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}", "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}", "--rpc_thread_num=2"], log)
        wait_for_port(self.rpc_port, self.master, log)
        wait_for_port(self.http_port, self.master, log)

    def start_holder(self) -> None:
        log = os.path.join(self.logs, "holder.log")
        self.holder = self._spawn([
            os.path.join(self.dir, "mooncake_client"), "--host=127.0.0.1",
            f"--port={self.holder_port}", f"--master_server_address={self.master_address}",
            f"--metadata_server={self.metadata_server}",
            f"--global_segment_size={self.segment_bytes}", "--local_buffer_size=0",
            "--protocol=tcp", "--threads=2"], log)

    def __enter__(self) -> "MooncakeCluster":
        try:
            self.start_master()
            self.start_holder()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self.holder, grace=1.0)
        stop(self.master)

    def wait_ready(self, store: Any, timeout: float = 20.0) -> None:
        """Until a put through `store` (a kvt.cluster.ClusterStore) lands: the holder's
        segment is mounted."""
        end = time.monotonic() + timeout
        probe = f"kvt-test-probe/{os.getpid()}/{time.monotonic_ns()}"
        last: Optional[Exception] = None
        while time.monotonic() < end:
            if self.holder is not None and self.holder.poll() is not None:
                raise RuntimeError(f"mooncake_client exited ({self.holder.returncode}):\n"
                                   f"{read(os.path.join(self.logs, 'holder.log'))}")
            try:
                store.put_raw(probe, b"ready", timeout=2.0)
                store.remove([probe])
                return
            except ClusterError as error:
                last = error
            time.sleep(0.1)
        raise RuntimeError(f"no segment to put into after {timeout} s ({last}):\n"
                           f"{read(os.path.join(self.logs, 'holder.log'))}")

    def master_log(self) -> str:
        return read(os.path.join(self.logs, "master.log"))
