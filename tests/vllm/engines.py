"""Test support: vLLM engines (tests/vllm/engine_host.py) as child processes, started in parallel
and driven over pipes; kvtd (//server:kvtd) on a fixed port that survives a restart; the tiny
family's ridge mappers fitted once per suite with `kvt fit` (tests/vllm/family.py)."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))


def outcome(result: dict) -> dict:
    """A request result's connector outcome (kv_transfer_params["kvt"]; {} when absent)."""
    return (result.get("kv_transfer_params") or {}).get("kvt", {})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """One engine process. start() returns at once; wait_ready() blocks until it has loaded."""

    def __init__(self, name: str, model_dir: str, config: Dict[str, Any], log_dir: str,
                 max_model_len: int = 1024, block_size: int = 32, env: Optional[dict] = None,
                 no_connector: bool = False, dtype: str = "float32",
                 null_connector: bool = False) -> None:
        self.name = name
        self.cmd = [sys.executable, os.path.join(HERE, "engine_host.py"), f"--model={model_dir}",
                    f"--config={json.dumps(config)}", f"--max_model_len={max_model_len}",
                    f"--block_size={block_size}", f"--dtype={dtype}"] + \
            (["--no_connector"] if no_connector else []) + \
            (["--null_connector"] if null_connector else [])
        self.log_path = os.path.join(log_dir, f"engine-{name}.log")
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self._answers: "queue.Queue[dict]" = queue.Queue()
        self.proc: Optional[subprocess.Popen] = None
        self.start_s = None

    def start(self) -> "Engine":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=self.env, text=True, bufsize=1,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@kvt "):
                self._answers.put(json.loads(line[6:]))
            else:
                self._log.write(line)
                self._log.flush()
        self._answers.put({"ok": False, "error": f"engine {self.name} exited"})

    def _get(self, timeout: float) -> dict:
        try:
            return self._answers.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"engine {self.name}: no answer in {timeout} s; log "
                               f"{self.log_path}:\n{self.log_tail()}") from None

    def wait_ready(self, timeout: float = 400) -> "Engine":
        answer = self._get(timeout)
        if not answer.get("ready"):
            raise RuntimeError(f"engine {self.name} failed to start: {answer}\n{self.log_tail()}")
        self.start_s = answer["start_s"]
        return self

    def generate(self, requests: List[dict], timeout: float = 300) -> List[dict]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "generate", "requests": requests}) + "\n")
        self.proc.stdin.flush()
        answer = self._get(timeout)
        if not answer.get("ok"):
            raise RuntimeError(f"engine {self.name}: {answer.get('error')}\n{self.log_tail()}")
        return answer["results"]

    def metrics(self, timeout: float = 60) -> Dict[str, float]:
        """vLLM's vllm:kvt_* counters of this engine (KvtConnectorStats on /metrics)."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "metrics"}) + "\n")
        self.proc.stdin.flush()
        answer = self._get(timeout)
        if not answer.get("ok"):
            raise RuntimeError(f"engine {self.name}: {answer.get('error')}")
        return answer["metrics"]

    def one(self, prompt: List[int], max_tokens: int = 16, kvt: Optional[dict] = None,
            cache_salt: Optional[str] = None, logprobs: Optional[int] = None, **extra) -> dict:
        r = {"prompt": list(prompt), "max_tokens": max_tokens, "kvt": kvt,
             "cache_salt": cache_salt, "logprobs": logprobs, **extra}
        return self.generate([r])[0]

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def log_lines(self, needle: str) -> List[str]:
        with open(self.log_path, errors="replace") as f:
            return [line for line in f if needle in line]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except Exception:
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_engines(engines: List[Engine]) -> List[Engine]:
    for e in engines:
        e.start()
    for e in engines:
        e.wait_ready()
    return engines
