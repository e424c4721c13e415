"""Start ``fxcompiler serve`` as a subprocess on 127.0.0.1 (a free port) and stop it (SIGTERM) for tests."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# The served engine's options; the in-process reference LLM is built with the same ones.
# a context of 512 leaves a disconnected stream (max_tokens 480) long enough to be aborted, not finished,
# when the host is busy; 64-row decode buckets serve the concurrency test's 250 streams
SERVE_FLAGS = ["--max-seq-len-to-capture", "512", "-pb", "1,64", "-pb", "4,64", "-db", "1,512", "-db", "16,512",
               "-db", "64,512",
               "--threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as name -> value (``name[reason]`` for ``request_success_total{finished_reason}``)."""
        text = httpx.get(self.base_url + "/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            m = re.match(r'^(fxcompiler:[a-z0-9_]+)(\{[^}]*\})? ([-+0-9.eE]+|NaN)$', line)
            if m:
                reason = re.search(r'finished_reason="([a-z]+)"', m.group(2) or "")
                out[m.group(1) + (f"[{reason.group(1)}]" if reason else "")] = float(m.group(3))
        return out

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful shutdown), then the exit code; SIGKILL only when it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(model: str | Path, workdir: Path, *, served_name: str = "tiny", api_key: str | None = None,
                 extra_flags: list[str] | None = None, startup_timeout: float = 600.0,
                 base_flags: list[str] | None = None) -> ServerProcess:
    """Launch the server and wait (bounded) until ``/health`` answers 200; ``base_flags`` replace
    ``SERVE_FLAGS`` (the decoder's buckets and context)."""
    port = free_port()
    log_path = workdir / "server.log"
    cmd = [sys.executable, "-m", "fxcompiler.cli", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", served_name, "--cache-dir", str(workdir / "cache"),
           *(SERVE_FLAGS if base_flags is None else base_flags),
           *(extra_flags or [])]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=Path(__file__).resolve().parents[2])
    server = ServerProcess(proc, port, log_path, api_key)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fxcompiler serve exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"fxcompiler serve did not become healthy in {startup_timeout} s:\n{server.log()}")
