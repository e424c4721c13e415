"""A kernel build or a compile killed with SIGKILL at any point never hangs or poisons the next start."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRACTIONS = (0.05, 0.2, 0.4, 0.6, 0.8, 0.95)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process we started, then (cleanup) the compilers it left running."""
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what this test started
    except (ProcessLookupError, PermissionError):
        pass


def _probe_code(src: Path) -> str:
    return textwrap.dedent(f"""
        import ctypes
        from pathlib import Path
        from backends.cpu import _build
        src = Path({str(src)!r})
        name = "fxc_probe_" + _build.source_digest([src], ["-O1"])
        _build.load_extension(name, [src], ["-O1"], is_python_module=False)
        print(ctypes.CDLL(str(_build.cache_dir() / name / (name + ".so"))).fxc_kill_probe())
    """)


def _run(code: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout, start_new_session=True)


@pytest.mark.slow
def test_kernel_build_killed_at_any_point_never_blocks_the_next(tmp_path):
    env = {**os.environ, "FXCOMPILER_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    # a source with some work in it, so a build has stages to be killed in
    body = "\n".join(f"template <int N> int f{i}() {{ return N + {i}; }} int g{i}() {{ return f{i}<{i}>(); }}"
                     for i in range(200))

    def source(i: int) -> Path:
        d = tmp_path / f"src{i}"
        d.mkdir()
        p = d / "probe.cpp"
        p.write_text(body + f'\nextern "C" int fxc_kill_probe() {{ return 42 + {i} - {i}; }}\n')
        return p

    t0 = time.monotonic()
    ok = _run(_probe_code(source(99)), env, 600)
    assert ok.returncode == 0 and ok.stdout.strip() == "42", ok.stderr[-2000:]
    full = time.monotonic() - t0
    for i, frac in enumerate(FRACTIONS):
        src = source(i)
        proc = subprocess.Popen([sys.executable, "-c", _probe_code(src)], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(frac * full)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)  # the builder only: its compiler may go on, orphaned
        proc.wait()
        again = _run(_probe_code(src), env, max(120, 4 * full))  # would hang forever on a stale lock
        _kill_group(proc)
        assert again.returncode == 0 and again.stdout.strip() == "42", (frac, again.stderr[-2000:])


COMPILE = textwrap.dedent("""
    import json, sys
    from fxcompiler import LLM, SamplingParams
    llm = LLM(sys.argv[1], max_seq_len_to_capture=128, cache_dir=sys.argv[2])
    out = llm.generate(None, SamplingParams(max_tokens=8, temperature=0), prompt_token_ids=[[1, 5, 6, 7, 8], [1, 9, 3]])
    print("RESULT", json.dumps([o.outputs[0].token_ids for o in out]))
    llm.shutdown()
""")


def _result(p: subprocess.CompletedProcess):
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr[-3000:]
    return json.loads(line[-1][7:])


@pytest.mark.slow
def test_compile_killed_at_any_point_never_poisons_the_next_start(llama_dir, tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    reference = _result(subprocess.run([sys.executable, "-c", COMPILE, str(llama_dir), str(tmp_path / "ref")],
                                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=900))
    full = time.monotonic() - t0
    for frac in FRACTIONS:
        proc = subprocess.Popen([sys.executable, "-c", COMPILE, str(llama_dir), str(cache)], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(frac * full)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _kill_group(proc)
    final = subprocess.run([sys.executable, "-c", COMPILE, str(llama_dir), str(cache)], capture_output=True,
                           text=True, cwd=ROOT, env=env, timeout=max(300, 4 * full))
    assert _result(final) == reference
    leftovers = [p for d in ("compiled", "captured") for p in (cache / d).rglob(".tmp-*")]
    assert not leftovers, leftovers
