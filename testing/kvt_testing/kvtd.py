"""kvtd (//server:kvtd from the runfiles) as a real child process on an OS-picked
port, its port read from the JSON "listening" log line, stderr kept in a file for failures, and
killed and reaped on exit (the Python counterpart of tests/kvtd_process.h)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import List, Optional

from kvt_testing.runfiles import runfile, test_tmpdir


class Kvtd:
    """One kvtd child process. Use as a context manager; `port` is set once it listens."""

    def __init__(self, flags: List[str], name: str = "kvtd") -> None:
        self.binary = runfile("server/kvtd")
        self.flags = flags
        self.port = 0
        self._stderr_path = os.path.join(
            test_tmpdir(), f"{name}.{os.getpid()}.{time.monotonic_ns()}.stderr")
        self._process: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Kvtd":
        with open(self._stderr_path, "wb") as stderr:
            self._process = subprocess.Popen([self.binary] + self.flags, stdout=subprocess.DEVNULL,
                                             stderr=stderr, start_new_session=True)
        self.port = self._wait_for_port()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stderr(self) -> str:
        with open(self._stderr_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def _log_lines(self) -> List[dict]:
        lines = []
        for line in self.stderr().splitlines():
            if line.startswith("{"):
                try:
                    lines.append(json.loads(line))
                except ValueError:
                    pass
        return lines

    def _wait_for_port(self, timeout: float = 30.0) -> int:
        assert self._process is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in self._log_lines():
                if line.get("msg") == "listening" and line.get("port"):
                    return int(line["port"])
            if self._process.poll() is not None:
                raise RuntimeError(f"kvtd exited ({self._process.returncode}) before listening:\n"
                                   f"{self.stderr()}")
            time.sleep(0.02)
        raise RuntimeError(f"kvtd did not log 'listening' within {timeout} s:\n{self.stderr()}")
