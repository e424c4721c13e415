"""The machine code of the register-blocked kernels: every row count's instance is a function of its own, and on
AVX-512 builds its innermost multiply-accumulate loops (FMA, VPDPBUSD) keep the accumulators in registers.

Inlined into a dispatching lambda beside the other row counts, GCC kept some instances' accumulators on the stack
and stored them every k step (fp32 at M = 64: the 9-row block at half the rate of the 11-row ones); the kernels
are `noinline` since (`FXC_PANEL`, backends/cpu/README.md). Loops over an accumulator array that GCC unrolls only
after its scalar replacement leave the array on the stack too (the W8A8 VNNI micro-kernel ran at a third of its
rate): their loops carry `#pragma GCC unroll`. These checks read the libraries this process loaded with binutils'
`objdump`, which the kernel build itself needs (`as`, `ld`).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import backends.cpu as fxc
from backends.cpu import _build, attention, quant, w8a8

_FUNC = re.compile(r"^[0-9a-f]+ <(.*)>:$")
_INSN = re.compile(r"^\s*([0-9a-f]+):\s*(.*)$")
_JUMP = re.compile(r"^j\w+\s+([0-9a-f]+)\b")
_STACK_STORE = re.compile(r"^vmov\w*\s+%[xyz]mm\d+,(-?0x[0-9a-f]+)?\(%r[sb]p\)")
_MAC = re.compile(r"^v(fmadd|pdpbusd)")  # the multiply-accumulates of the fp32 and int8 kernels


def _loaded_library(prefix: str) -> str:
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and Path(fields[-1]).name.startswith(prefix) and fields[-1].endswith(".so"):
            return fields[-1]
    raise AssertionError(f"no {prefix}*.so mapped in this process")


def _libraries() -> tuple[str, str, str, bool]:
    """(fxc_cpu, fxc_quant and fxc_w8a8 libraries, AVX-512 build) of this process."""
    if not _build.can_build():
        pytest.skip("no C++ compiler / no AVX2 on this machine: ATen fallback is in use")
    assert fxc.kernels_available() and quant.ensure_loaded() and w8a8.ensure_loaded(), _build.state()["error"]
    isa = _build.state()["isa"]
    libs = tuple(_loaded_library(f"{prefix}_{isa}_") for prefix in ("fxc_cpu", "fxc_quant", "fxc_w8a8"))
    return (*libs, isa == "avx512")


def _functions(lib: str, wanted) -> dict[str, list[tuple[int, str]]]:
    """Demangled name -> [(address, instruction)] of the functions of lib whose name wanted(name) accepts."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", lib], capture_output=True, text=True,
                          check=True).stdout
    out: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            current = m.group(1) if wanted(m.group(1)) else None
            if current is not None:
                out[current] = []
            continue
        m = _INSN.match(line)
        if m and current is not None:
            out[current].append((int(m.group(1), 16), m.group(2)))
    return out


def _innermost_loops(insns: list[tuple[int, str]]) -> list[list[str]]:
    """The instructions of each backward jump's body that holds no other backward jump."""
    index = {a: i for i, (a, _) in enumerate(insns)}
    backward = []
    for i, (a, t) in enumerate(insns):
        m = _JUMP.match(t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            backward.append((index[int(m.group(1), 16)], i))
    return [[t for _, t in insns[s:e + 1]] for s, e in backward
            if not any(s <= s2 and e2 < e for s2, e2 in backward if (s2, e2) != (s, e))]


def _row_kernels(lib: str, patterns: list[str], rows: int) -> dict[str, list[tuple[int, str]]]:
    names = {p.format(r=r) for p in patterns for r in range(1, rows + 1)}
    funcs = _functions(lib, lambda name: any(n in name for n in names))
    missing = sorted(n for n in names if not any(n in f for f in funcs))
    assert not missing, f"inlined into their callers (no function of their own): {missing}"
    return funcs


def test_every_row_count_is_its_own_function_with_its_accumulators_in_registers():
    cpu_lib, quant_lib, w8a8_lib, avx512 = _libraries()
    mrmax = 12 if avx512 else 3
    fp32 = ["panel_f32_packed<{r}>", "panel_direct<fxc::(anonymous namespace)::WF32, {r}, false>"]
    kernels = _row_kernels(cpu_lib, fp32, mrmax)
    kernels |= _row_kernels(quant_lib, ["micro<{r}>("], 12 if avx512 else 4)
    # the W8A8 int8 micro-kernel of VNNI CPUs, compiled into AVX-512 builds whatever this CPU has
    kernels |= _row_kernels(w8a8_lib, ["micro_avx512vnni<{r}>("], 12) if avx512 else {}
    if not avx512:
        return  # 16 ymm registers: the 4-row AVX2 instances spill by necessity
    checked = 0
    for name, insns in kernels.items():
        for body in _innermost_loops(insns):
            if not any(_MAC.match(t) for t in body):
                continue
            checked += 1
            stores = [t for t in body if _STACK_STORE.match(t)]
            assert not stores, f"{name}: an FMA loop stores vector registers to the stack: {stores[:4]}"
    assert checked >= len(kernels)  # every kernel has its FMA loop


def test_decode_attention_v_pass_keeps_its_accumulators_in_registers():
    """The decode attention kernel's V pass holds the query heads of one KV head in registers over a block's tokens;
    with the head count as a run-time loop bound GCC kept them on the stack (a store and a load per token)."""
    _libraries()
    if _build.state()["isa"] != "avx512":
        pytest.skip("the decode attention kernel is written for AVX-512; AVX2 builds run ATen-style loops")
    assert attention.kernel_module() is not None, _build.state()["error"]
    lib = _loaded_library("fxc_paged_attention_avx512_")
    caches = ["float", "c10::BFloat16", "signed char"]  # fp8 caches keep a few spills of their conversion
    # head dims 16, 32, 64 (1, 2, 4 zmm a row); at 128 the 3 heads x 8 accumulators and a row's 8 vectors fill all
    # 32 registers, and the broadcast score takes one spill
    funcs = _functions(lib, lambda name: any(f"piece_avx512<{c}, {dv}>" in name for c in caches for dv in (1, 2, 4)))
    assert len(funcs) == 3 * len(caches), sorted(funcs)
    for name, insns in funcs.items():
        for body in _innermost_loops(insns):
            if any(_MAC.match(t) for t in body):
                stores = [t for t in body if _STACK_STORE.match(t)]
                assert not stores, f"{name}: an FMA loop stores vector registers to the stack: {stores[:4]}"
