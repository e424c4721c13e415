"""Property tests of the fxc CPU kernels (backends/cpu, fxc::linear_f8 of backends/cpu/quant too) against float64 ATen references.

Tolerances: the kernels accumulate in fp32 in a different order than the reference, so the
error bound scales with sum_k |x_k w_k| (``absdot``): |y - ref| <= 1e-4 * absdot (fp32 output).
A bf16 output adds its own rounding: 2^-8 |ref|.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import backends.cpu as fxc
from backends.cpu import _build

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def _built():
    fxc.kernels_available()  # the first compile happens here, not inside a hypothesis example


def _rand(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _check(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, bias: torch.Tensor | None):
    """y vs float64 reference x @ w64^T + bias."""
    x64 = x.double()
    ref = x64 @ w64.T
    absdot = x64.abs() @ w64.abs().T
    if bias is not None:
        ref = ref + bias.double()
        absdot = absdot + bias.double().abs()
    assert y.shape == ref.shape
    assert y.dtype == x.dtype
    tol = 1e-4 * absdot + 1e-6
    if y.dtype == torch.bfloat16:
        tol = tol + 2.0**-8 * ref.abs()
    err = (y.double() - ref).abs()
    bad = err > tol
    assert not bad.any(), f"max err {err.max().item():.3g}, {bad.sum().item()} elements out of tolerance"


def test_kernels_built():
    if not _build.can_build():
        pytest.skip("no C++ compiler / no AVX2 on this machine: ATen fallback is in use")
    assert fxc.kernels_available(), _build.state()["error"]
    assert fxc.isa() in ("avx512", "avx512+amx", "avx512+bf16dot", "avx2")
    expected = os.environ.get("FXCOMPILER_EXPECT_ISA")  # set by test_isa_paths for a forced path
    if expected:
        assert fxc.isa() == expected, f"asked for {expected}, running {fxc.isa()}"


def test_software_prefetch_hints_leave_results_unchanged():
    """The decode kernels' weight-stream prefetch hint per weight kind (AMD Zen 5 on: NTA for fp32 and int8, none
    for bf16; older AMD: none; elsewhere T0; FXCOMPILER_CPU_PREFETCH sets one for all) changes timing only: every
    path gives the same bits with every hint."""
    if not fxc.kernels_available():
        pytest.skip("no C++ kernels here")
    with open("/proc/cpuinfo") as f:
        info = f.read()
    amd = "AuthenticAMD" in info
    family = int(re.search(r"^cpu family\s*:\s*(\d+)", info, re.M).group(1))
    env = os.environ.get("FXCOMPILER_CPU_PREFETCH")
    one = {"0": "none", "1": "t0", "t0": "t0", "nta": "nta"}.get(env or "")
    if not one and amd:
        one = None if family >= 26 else "none"  # Zen 5 on: per kind; older AMD: none
    expected = ({k: one for k in _build.PREFETCH_KINDS} if one else
                {"fp32": "nta", "bf16": "none", "int8": "nta"} if amd else {k: "t0" for k in _build.PREFETCH_KINDS})
    assert _build.prefetch_hints() == expected
    with pytest.raises(ValueError, match="fp16"):
        _build.set_prefetch_hints(fp16="t0")
    with pytest.raises(ValueError, match="int8='t3'"):
        _build.set_prefetch_hints(int8="t3")
    before = _build.prefetch_hints()
    try:
        for m, wdt, xdt in [(1, torch.float32, torch.float32), (1, torch.bfloat16, torch.bfloat16),
                            (3, torch.bfloat16, torch.float32), (17, torch.bfloat16, torch.bfloat16),
                            (40, torch.float32, torch.float32), (1, torch.int8, torch.float32),
                            (4, torch.int8, torch.bfloat16), (7, torch.float32, torch.float32)]:
            w = _rand(70, 96, seed=m)
            if wdt == torch.int8:
                q, sc = fxc.quantize_linear_weight_int8(w, -1)
                run = lambda x: torch.ops.fxc.linear_w8(x, q, sc, None, 70, -1)  # noqa: E731
            else:
                packed = fxc.pack_linear_weight(w, wdt)
                run = lambda x: torch.ops.fxc.linear(x, packed, None, 70)  # noqa: E731
            x = _rand(m, 96, seed=m + 1, dtype=xdt)
            outs = []
            for hint in _build.PREFETCH_HINTS.values():
                _build.set_prefetch_hints(**{k: hint for k in _build.PREFETCH_KINDS})
                assert set(_build.prefetch_hints().values()) == {hint}
                outs.append(run(x))
            for o in outs[1:]:
                assert torch.equal(outs[0], o), (m, wdt, xdt)
    finally:
        _build.set_prefetch_hints(**before)
    assert _build.prefetch_hints() == before


def test_unknown_prefetch_setting_is_refused_before_anything_is_built():
    code = "from backends.cpu import _build; _build.ensure_loaded()"
    env = {**os.environ, "FXCOMPILER_CPU_PREFETCH": "yes"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "FXCOMPILER_CPU_PREFETCH must be 0, 1, t0 or nta, got 'yes'" in r.stderr


@SETTINGS
@given(st.integers(13, 80), st.one_of(st.integers(1, 300), st.sampled_from([576, 1536])), st.integers(33, 300),
       st.integers(0, 2**31 - 1), st.booleans(), st.sampled_from([1, 2, 3]))
def test_fp32_next_panel_prefetch_same_bits_and_matches_aten(m, k, n, seed, with_bias, threads):
    """fp32 weights, more rows than one register block (several row blocks per panel): the L2 prefetch of
    the next panel (on by default, FXCOMPILER_CPU_PANEL_PREFETCH=0 / set_panel_prefetch) gives the same bits
    on and off, for any split of the panels between threads, and agrees with ATen's F.linear."""
    if not fxc.kernels_available():
        pytest.skip("no C++ kernels here")
    w, x = _rand(n, k, seed=seed), _rand(m, k, seed=seed + 1)
    bias = _rand(n, seed=seed + 2) if with_bias else None
    packed = fxc.pack_linear_weight(w, torch.float32)
    before, nthreads = _build.set_panel_prefetch(True), torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        on = torch.ops.fxc.linear(x, packed, bias, n)
        assert not _build.set_panel_prefetch(False)
        off = torch.ops.fxc.linear(x, packed, bias, n)
    finally:
        _build.set_panel_prefetch(before)
        torch.set_num_threads(nthreads)
    assert torch.equal(on, off)
    torch.testing.assert_close(on, F.linear(x, w, bias), rtol=1e-4, atol=1e-4 * (k ** 0.5))
    _check(on, x, w.double(), bias)


@st.composite
def problems(draw):
    m = draw(st.integers(1, 64))
    k = draw(st.one_of(st.integers(1, 300), st.sampled_from([16, 32, 64, 96, 576])))
    n = draw(st.one_of(st.integers(1, 200), st.sampled_from([16, 32, 48, 192])))
    return m, k, n, draw(st.integers(0, 2**31 - 1))


@SETTINGS
@given(problems(), st.sampled_from(["fp32", "bf16", "bf16-xbf16", "fp32-xbf16"]), st.booleans(), st.booleans())
def test_linear_matches_reference(prob, mode, with_bias, batched):
    m, k, n, seed = prob
    wdt = torch.float32 if mode.startswith("fp32") else torch.bfloat16
    xdt = torch.bfloat16 if mode.endswith("xbf16") else torch.float32
    w = _rand(n, k, seed=seed)
    x = _rand(m, k, seed=seed + 1, dtype=xdt)
    bias = _rand(n, seed=seed + 2) if with_bias else None
    wp = fxc.pack_linear_weight(w, wdt)
    if batched and m % 2 == 0:
        y = torch.ops.fxc.linear(x.reshape(2, m // 2, k), wp, bias, n).reshape(m, n)
    else:
        y = torch.ops.fxc.linear(x, wp, bias, n)
    _check(y, x, w.to(wdt).double(), bias)


@SETTINGS
@given(problems(), st.sampled_from([-1, 32, 64, 128, "K"]), st.booleans(), st.booleans())
def test_linear_w8_matches_dequantised_reference(prob, group, with_bias, xbf16):
    m, k, n, seed = prob
    if group == "K":
        group = k
    elif group > 0:
        k = max(1, k // group) * group  # K must be a multiple of the group size
    w = _rand(n, k, seed=seed)
    x = _rand(m, k, seed=seed + 1, dtype=torch.bfloat16 if xbf16 else torch.float32)
    bias = _rand(n, seed=seed + 2) if with_bias else None
    q, s = fxc.quantize_linear_weight_int8(w, group)
    y = torch.ops.fxc.linear_w8(x, q, s, bias, n, group)
    wd = fxc.dequantize_linear_weight_int8(q, s, n, group)
    _check(y, x, wd.double(), bias)
    # the quantisation itself: |w - dequant(q)| <= scale / 2
    if group in (-1, k):
        step = s[:n, None]
    else:
        step = s.permute(0, 2, 1).reshape(-1, k // group)[:n].repeat_interleave(group, 1)
    assert ((wd - w).abs() <= step / 2 + 1e-6).all()


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(1, 100), st.integers(1, 100), st.sampled_from([torch.float32, torch.bfloat16]))
def test_aten_fallback_matches_kernel(m, k, n, wdt):
    """The ATen fallbacks and the kernels agree within twice ``_check``'s bound (each is within
    1e-4 of sum |x||w| of the exact value: the AMX path splits fp32 x into two bf16 parts, ~2^-17
    relative, so outputs that cancel differ by more than 1e-4 of their own size)."""
    w, x, b = _rand(n, k, seed=m), _rand(m, k, seed=k), _rand(n, seed=n)

    def close(a, c, w_used):
        bound = 2e-4 * (x.double().abs() @ w_used.double().abs().T + b.double().abs()) + 1e-6
        assert a.shape == c.shape and ((a.double() - c.double()).abs() <= bound).all()

    wp = fxc.pack_linear_weight(w, wdt)
    close(fxc.linear_aten(x, wp, b, n), torch.ops.fxc.linear(x, wp, b, n), w.to(wdt))
    q, s = fxc.quantize_linear_weight_int8(w)
    close(fxc.linear_w8_aten(x, q, s, b, n, -1), torch.ops.fxc.linear_w8(x, q, s, b, n, -1),
          fxc.dequantize_linear_weight_int8(q, s, n, -1))


@pytest.mark.parametrize("m", [100, 256])
def test_large_m(m):
    k, n = 200, 90
    w, x, b = _rand(n, k, seed=m), _rand(m, k, seed=1), _rand(n, seed=2)
    for dt in (torch.float32, torch.bfloat16):
        _check(torch.ops.fxc.linear(x, fxc.pack_linear_weight(w, dt), b, n), x, w.to(dt).double(), b)
        _check(torch.ops.fxc.linear(x.bfloat16(), fxc.pack_linear_weight(w, dt), b, n), x.bfloat16(),
               w.to(dt).double(), b)
    for g in (-1, 40):
        q, s = fxc.quantize_linear_weight_int8(w, g)
        _check(torch.ops.fxc.linear_w8(x, q, s, b, n, g), x, fxc.dequantize_linear_weight_int8(q, s, n, g).double(), b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_unpack_roundtrip(dtype):
    w = _rand(45, 33, seed=0, dtype=dtype)
    wp = fxc.pack_linear_weight(w, dtype)
    assert wp.shape[0] == 2
    assert torch.equal(fxc.unpack_linear_weight(wp, 45, 33), w)


def test_noncontiguous_and_empty_inputs():
    w, b = _rand(40, 24, seed=3), _rand(40, seed=4)
    wp = fxc.pack_linear_weight(w)
    x = _rand(24, 5, seed=5).T  # non-contiguous [5, 24]
    torch.testing.assert_close(torch.ops.fxc.linear(x, wp, b, 40), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert torch.ops.fxc.linear(torch.empty(0, 24), wp, b, 40).shape == (0, 40)
    with pytest.raises(RuntimeError):
        torch.ops.fxc.linear(_rand(2, 23, seed=0), wp, b, 40)  # wrong K


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        w = _rand(48, 40, seed=7)
        self.register_buffer("wp", fxc.pack_linear_weight(w, torch.bfloat16))
        self.register_buffer("b", _rand(48, seed=8))
        q, s = fxc.quantize_linear_weight_int8(_rand(16, 48, seed=9), 16)
        self.register_buffer("q", q)
        self.register_buffer("s", s)

    def forward(self, x):
        h = torch.relu(torch.ops.fxc.linear(x, self.wp, self.b, 48))
        return torch.ops.fxc.linear_w8(h, self.q, self.s, None, 16, 16)


def test_export_keeps_single_nodes():
    mod = _Tiny().eval()
    x = _rand(3, 40, seed=10)
    ep = torch.export.export(mod, (x,), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.fxc.linear.default) == 1
    assert targets.count(torch.ops.fxc.linear_w8.default) == 1
    assert not any("mm" in str(t) or "addmm" in str(t) for t in targets)
    torch.testing.assert_close(ep.module()(x), mod(x))
    x2 = _rand(5, 40, seed=11)  # dynamic M
    ep_dyn = torch.export.export(mod, (x,), dynamic_shapes=({0: torch.export.Dim("m", min=1, max=256)},),
                                 strict=False)
    torch.testing.assert_close(ep_dyn.module()(x2), mod(x2))


def _run_py(code: str, env_extra: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_failed_build_falls_back_with_one_warning(tmp_path):
    code = """
        import warnings, torch, torch.nn.functional as F
        import backends.cpu as fxc
        w, x = torch.randn(20, 30), torch.randn(3, 30)
        wp = fxc.pack_linear_weight(w)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            ys = [torch.ops.fxc.linear(x, wp, None, 20) for _ in range(3)]
            ok = fxc.kernels_available()
        msgs = [str(r.message) for r in rec if "fxcompiler" in str(r.message)]
        assert len(msgs) == 1, msgs
        assert not ok and fxc.isa() == "aten"
        torch.testing.assert_close(ys[0], F.linear(x, w), rtol=1e-4, atol=1e-4)
        print("OK", msgs[0])
    """
    r = _run_py(code, {"CXX": str(tmp_path / "no-such-compiler"), "FXCOMPILER_CACHE_DIR": str(tmp_path),
                       "FXCOMPILER_CPU_ISA": ""})
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


_PATHS_CODE = """
    import torch
    import backends.cpu as fxc
    torch.manual_seed(0)
    for m, k, n in [(1, 77, 50), (2, 64, 70), (3, 130, 70), (5, 64, 33), (13, 96, 40), (17, 33, 100), (40, 128, 64), (130, 64, 70)]:
        w, x, b = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
        for dt in (torch.float32, torch.bfloat16):
            wr = w.to(dt).double()
            y = torch.ops.fxc.linear(x, fxc.pack_linear_weight(w, dt), b, n)
            torch.testing.assert_close(y.double(), x.double() @ wr.T + b.double(), rtol=1e-4, atol=1e-4)
        for g in (-1, 32 if k % 32 == 0 else k):
            q, s = fxc.quantize_linear_weight_int8(w, g)
            y = torch.ops.fxc.linear_w8(x, q, s, b, n, g)
            wd = fxc.dequantize_linear_weight_int8(q, s, n, g).double()
            torch.testing.assert_close(y.double(), x.double() @ wd.T + b.double(), rtol=1e-4, atol=1e-4)
    from backends.cpu import _build
    w, x = torch.randn(300, 576), torch.randn(32, 576)  # fp32, several row blocks and panels per thread
    wp = fxc.pack_linear_weight(w, torch.float32)
    assert _build.set_panel_prefetch(False) is False
    off = torch.ops.fxc.linear(x, wp, None, 300)
    assert _build.set_panel_prefetch(True) is True
    assert torch.equal(torch.ops.fxc.linear(x, wp, None, 300), off)
    torch.testing.assert_close(off, torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-3)
    print("OK", fxc.isa())
"""


def test_avx512_paths_without_amx():
    if not (_build.can_build() and fxc.kernels_available() and fxc.isa() == "avx512+amx"):
        pytest.skip("AMX machine only: checks the AVX-512 paths that AMX otherwise takes over")
    r = _run_py(_PATHS_CODE, {"FXCOMPILER_CPU_AMX": "0"})
    assert r.returncode == 0 and "OK avx512" in r.stdout and "amx" not in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(not _build.can_build() or _build.detect_isa() != "avx512",
                    reason="needs the AVX-512 machine to also exercise the AVX2 build")
def test_avx2_build_matches_reference():
    """The AVX2 variant (used on CPUs without AVX-512), built and checked in a subprocess."""
    r = _run_py(_PATHS_CODE, {"FXCOMPILER_CPU_ISA": "avx2"})
    assert r.returncode == 0 and "OK avx2" in r.stdout, r.stdout + r.stderr


# AMX path (bf16 / int8 weights, M >= 8): row blocks of 16 in pairs, K blocks of 8 chunks of 32 k with
# C spilled between them, panels split between threads (or row pairs when there are fewer panels than
# threads), K tails that are not whole chunks, N tails, per-group int8 scales.
@pytest.mark.parametrize("k,n", [(576, 96), (1536, 40), (31, 33), (577, 65), (300, 20), (64, 200)])
def test_amx_row_blocks_and_tails(k, n):
    w, b = _rand(n, k, seed=k), _rand(n, seed=n)
    wp = fxc.pack_linear_weight(w, torch.bfloat16)
    wb = w.bfloat16().double()
    x_all = _rand(256, k, seed=k + n)
    qg = {g: fxc.quantize_linear_weight_int8(w, g) for g in (-1, 32, 64, 128) if g < 0 or k % g == 0}
    full = {}
    for m in (8, 15, 16, 17, 31, 32, 33, 48, 64, 65, 100, 256):
        x = x_all[:m]
        for xdt in (torch.float32, torch.bfloat16):
            xx = x.to(xdt)
            y = torch.ops.fxc.linear(xx, wp, b, n)
            _check(y, xx, wb, b)
            # each row is computed independently of the others: the first rows do not depend on M
            key = ("bf16", xdt)
            if key in full:
                mm = min(m, full[key].shape[0])
                assert torch.equal(y[:mm], full[key][:mm])
            full[key] = y
        # bf16 x is exact: the same products summed in fp32, rounded once (fp32 x holding bf16 values
        # takes the hi + lo path with lo = 0 and must give the fp32 sums of which y_bf16 is the rounding)
        xb = x.bfloat16()
        yb = torch.ops.fxc.linear(xb, wp, None, n)
        yf = torch.ops.fxc.linear(xb.float(), wp, None, n)
        if fxc.isa().endswith("+bf16dot"):
            # bf16 x takes VDPBF16PS (pairs summed in another order than fp32 x's FMAs): the fp32 sums differ by
            # the accumulation order (~K * 2^-24 of sum |x||w|), then one bf16 rounding
            absdot = xb.double().abs() @ wb.abs().T
            bound = 2.0**-7 * yf.double().abs() + 1e-5 * absdot
            assert ((yf.bfloat16().double() - yb.double()).abs() <= bound).all()
        else:
            assert torch.equal(yf.bfloat16(), yb)
        for g, (q, s) in qg.items():
            y = torch.ops.fxc.linear_w8(x, q, s, b, n, g)
            _check(y, x, fxc.dequantize_linear_weight_int8(q, s, n, g).double(), b)


# fxc::linear_f8 (csrc/quant_kernels.cpp): fp8 e4m3 weights upcast in the kernel, scale per output channel.
def _f8_codes(n: int, k: int, seed: int) -> torch.Tensor:
    """Every e4m3 bit pattern but NaN (0x7F / 0xFF), uniformly: normals, subnormals, ±0, ±448."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x7E
    return raw.view(torch.float8_e4m3fn)


@SETTINGS
@given(problems(), st.booleans(), st.booleans(), st.booleans())
def test_linear_f8_matches_upcast_reference(prob, with_bias, xbf16, batched):
    from fxcompiler.ops.quant_linear import dequantize_linear_weight_fp8, linear_f8, linear_f8_reference, pack_fp8

    import backends.cpu.quant as quant

    m, k, n, seed = prob
    x = _rand(m, k, seed=seed + 1, dtype=torch.bfloat16 if xbf16 else torch.float32)
    bias = _rand(n, seed=seed + 2) if with_bias else None
    s = torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 0.01 + 1e-4
    q, ps = pack_fp8(_f8_codes(n, k, seed), s)
    wd = dequantize_linear_weight_fp8(q, ps, n)
    assert torch.equal(wd, _f8_codes(n, k, seed).float() * s[:, None])  # the upcast is exact
    if batched and m % 2 == 0:
        y = linear_f8(x.reshape(2, m // 2, k), q, ps, bias, n).reshape(m, n)
    else:
        y = linear_f8(x, q, ps, bias, n)
    _check(y, x, wd.double(), bias)
    ref = linear_f8_reference(x, q, ps, bias, n)
    assert ref.dtype == y.dtype and ref.shape == y.shape
    if _build.can_build():
        assert quant.isa() in ("avx512", "avx2")  # the C++ kernel ran, not the reference


def test_linear_f8_every_code_and_nan():
    """Each of the 256 codes upcasts to torch's value (one output per code: x = 1, a single k), NaN to NaN."""
    from fxcompiler.ops.quant_linear import linear_f8, pack_fp8

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(256, 1)
    q, s = pack_fp8(codes, torch.ones(256))
    for m in (1, 7):  # the direct (decode) path and the tile path
        y = linear_f8(torch.ones(m, 1), q, s, None, 256)
        torch.testing.assert_close(y, codes.float().T.expand(m, 256), rtol=0, atol=0, equal_nan=True)


def test_linear_f8_export_and_errors():
    from fxcompiler.ops.quant_linear import linear_f8, quantize_linear_weight_fp8

    q, s = quantize_linear_weight_fp8(_rand(20, 24, seed=1))

    class M(torch.nn.Module):
        def forward(self, x, q, s):
            return linear_f8(x, q, s, None, 20)

    x = _rand(3, 24, seed=2)
    ep = torch.export.export(M(), (x, q, s), dynamic_shapes=({0: torch.export.Dim("m", min=1, max=64)}, None, None),
                             strict=False)
    assert [n.target for n in ep.graph.nodes if n.op == "call_function"] == [torch.ops.fxc.linear_f8.default]
    torch.testing.assert_close(ep.module()(_rand(5, 24, seed=3), q, s), linear_f8(_rand(5, 24, seed=3), q, s, None, 20))
    assert linear_f8(torch.empty(0, 24), q, s, None, 20).shape == (0, 20)
    with pytest.raises(RuntimeError, match="K mismatch|K=23"):
        linear_f8(_rand(2, 23, seed=0), q, s, None, 20)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        linear_f8(x, q.view(torch.int8), s, None, 20)


_F8_PATHS_CODE = """
    import torch
    import backends.cpu.quant as quant
    from fxcompiler.ops.quant_linear import dequantize_linear_weight_fp8, linear_f8, quantize_linear_weight_fp8
    torch.manual_seed(0)
    for m, k, n in [(1, 77, 50), (2, 64, 70), (4, 130, 33), (5, 64, 33), (70, 96, 40)]:
        w, x, b = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
        q, s = quantize_linear_weight_fp8(w)
        wd = dequantize_linear_weight_fp8(q, s, n).double()
        y = linear_f8(x, q, s, b, n)
        torch.testing.assert_close(y.double(), x.double() @ wd.T + b.double(), rtol=1e-4, atol=1e-4)
    # fxc::linear_f8f8's kernel (per-token e4m3 rows in C++) equals its ATen composite bit for bit
    from fxcompiler.ops.f8_linear import linear_f8f8_composite
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fxc::linear_f8f8", "CPU")
    for m, k, n in [(1, 77, 50), (3, 64, 70), (5, 130, 33), (70, 96, 40)]:
        q, s = quantize_linear_weight_fp8(torch.randn(n, k))
        for dt in (torch.float32, torch.bfloat16):
            x, b = (torch.randn(m, k) * 5).to(dt), torch.randn(n)
            x[0, :3] = 0
            got, want = torch.ops.fxc.linear_f8f8(x, q, s, b, n), linear_f8f8_composite(x, q, s, b, n)
            assert torch.equal(got.view(torch.int16 if dt == torch.bfloat16 else torch.int32),
                               want.view(torch.int16 if dt == torch.bfloat16 else torch.int32)), (m, k, n, dt)
    print("OK", quant.isa())
"""


@pytest.mark.skipif(not _build.can_build() or _build.detect_isa() != "avx512",
                    reason="needs the AVX-512 machine to also exercise the AVX2 build")
def test_linear_f8_avx2_build_matches_reference():
    r = _run_py(_F8_PATHS_CODE, {"FXCOMPILER_CPU_ISA": "avx2"})
    assert r.returncode == 0 and "OK avx2" in r.stdout, r.stdout + r.stderr


# -- fxc::linear_w4 (backends/cpu/quant): M <= 4 streams the packed panel, larger M dequantises a tile --------
def _w4_problem(m, k, n, gs, seed):
    """Random int4 codes with random scales and mins (either sign), packed for fxc::linear_w4."""
    from fxcompiler.ops.quant_linear import pack_int4

    g = torch.Generator().manual_seed(seed)
    groups = -(-k // gs)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = torch.randn(n, groups, generator=g) * 0.05
    mins = torch.randn(n, groups, generator=g) * 0.3
    return pack_int4(q, s, mins, gs)


@SETTINGS
@given(st.integers(1, 12), st.integers(1, 160), st.integers(1, 100), st.sampled_from([2, 32, 64, 128]),
       st.integers(0, 2**31 - 1), st.booleans(), st.booleans(), st.booleans())
def test_linear_w4_matches_dequantised_reference(m, half_k, n, gs, seed, with_bias, xbf16, batched):
    """Both paths (M <= 4 direct, M > 4 tile), K not a multiple of the group, N tails, bf16 x: within the
    fp32-reordering bound of the float64 product with the exactly dequantised weight."""
    from fxcompiler.ops.quant_linear import dequantize_linear_weight_int4, linear_w4, linear_w4_reference

    import backends.cpu.quant as quant

    k = 2 * half_k
    packed, s, mins = _w4_problem(m, k, n, gs, seed)
    x = _rand(m, k, seed=seed + 1, dtype=torch.bfloat16 if xbf16 else torch.float32)
    bias = _rand(n, seed=seed + 2) if with_bias else None
    wd = dequantize_linear_weight_int4(packed, s, mins, n, gs)
    if batched and m % 2 == 0:
        y = linear_w4(x.reshape(2, m // 2, k), packed, s, mins, bias, n, gs).reshape(m, n)
    else:
        y = linear_w4(x, packed, s, mins, bias, n, gs)
    _check(y, x, wd.double(), bias)
    ref = linear_w4_reference(x, packed, s, mins, bias, n, gs)
    assert ref.dtype == y.dtype and ref.shape == y.shape
    if _build.can_build():
        assert quant.isa() in ("avx512", "avx2")  # the C++ kernel ran, not the reference


@SETTINGS
@given(st.integers(1, 9), st.integers(1, 100), st.integers(1, 70), st.sampled_from([2, 32, 128]), st.integers(0, 2**31 - 1),
       st.booleans())
def test_linear_w4_fp16_scales_equal_fp32_scales_bit_for_bit(m, half_k, n, gs, seed, xbf16):
    """Scales and mins stored as fp16 (pack_int4(compact=True), GGUF's own precision) give exactly the output of
    the same values stored as fp32, on both paths (M <= 4 direct, M > 4 tile): the upcast is exact and the
    arithmetic after it is the same."""
    from fxcompiler.ops.quant_linear import linear_w4, pack_int4, unpack_int4

    k = 2 * half_k
    q, s, mins = unpack_int4(*_w4_problem(m, k, n, gs, seed), n)
    s, mins = s.half().float(), mins.half().float()
    wide, compact = pack_int4(q, s, mins, gs), pack_int4(q, s, mins, gs, compact=True)
    assert compact[1].dtype == compact[2].dtype == torch.float16
    x = _rand(m, k, seed=seed + 1, dtype=torch.bfloat16 if xbf16 else torch.float32)
    bias = _rand(n, seed=seed + 2)
    y16, y32 = linear_w4(x, *compact, bias, n, gs), linear_w4(x, *wide, bias, n, gs)
    assert torch.equal(y16.view(torch.int16 if xbf16 else torch.int32), y32.view(torch.int16 if xbf16 else torch.int32))


def test_linear_w4_scale_dtype_errors():
    from fxcompiler.ops.quant_linear import linear_w4

    packed, s, mins = _w4_problem(1, 64, 40, 32, 3)
    x = _rand(1, 64, seed=4)
    with pytest.raises(RuntimeError, match="scales and mins must both be float32 or both float16"):
        linear_w4(x, packed, s.half(), mins, None, 40, 32)
    with pytest.raises(RuntimeError, match="scales and mins must both be float32 or both float16"):
        linear_w4(x, packed, s.double(), mins.double(), None, 40, 32)
    with pytest.raises(Exception, match="scales and mins must both be float32 or both float16"):
        _fake_w4(x, packed, s.half(), mins)


def _fake_w4(x, packed, s, mins):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxcompiler.ops.quant_linear import linear_w4

    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (x, packed, s, mins)]
        return linear_w4(*args[:4], None, 40, 32)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("compact", [False, True])
def test_linear_w4_decode_streams_match_reference_for_any_thread_count(m, compact):
    """M <= 4 walks a thread's panels as several streams in lock step, the leftover panels as one more group,
    with fewer streams where that avoids a panel alone (at M = 1, 4 streams on AVX-512): 23 panels (1 thread:
    4 x 5 + 3; 2 threads: 12 = 4 x 3 and 11 = 4 x 2 + 3; 3 threads: 8 = 4 x 2 and 7 = 4 + 3) and 9 panels (1
    thread: 3 x 3; 2 threads: 5 = 3 + 2 and 4), each within the fp32 bound of the float64 reference, and
    bit-identical for every thread count."""
    for panels in (23, 9):
        _w4_streams_case(m, compact, panels * 32 - 5)


def _w4_streams_case(m, compact, n):
    from fxcompiler.ops.quant_linear import dequantize_linear_weight_int4, linear_w4, pack_int4, unpack_int4

    k = 192
    packed, s, mins = _w4_problem(m, k, n, 32, 11)
    if compact:
        q, s, mins = unpack_int4(packed, s, mins, n)
        packed, s, mins = pack_int4(q, s.half().float(), mins.half().float(), 32, compact=True)
    x, bias = _rand(m, k, seed=12), _rand(n, seed=13)
    wd = dequantize_linear_weight_int4(packed, s, mins, n, 32).double()
    old = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(linear_w4(x, packed, s, mins, bias, n, 32))
    finally:
        torch.set_num_threads(old)
    _check(outs[0], x, wd, bias)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@SETTINGS
@given(st.integers(13, 150), st.integers(1, 96), st.integers(1, 70), st.integers(0, 2**31 - 1), st.booleans())
def test_linear_w4_tile_rows_do_not_depend_on_their_row_group(m, half_k, n, seed, xbf16):
    """M > 4: the tile path splits each 64-row block into balanced groups of up to 12 rows (AVX-512); a row's sums
    do not depend on the group it lands in, so every row equals the same row computed in a call of 5 rows."""
    from fxcompiler.ops.quant_linear import linear_w4

    k = 2 * half_k
    packed, s, mins = _w4_problem(m, k, n, 32, seed)
    x = _rand(m, k, seed=seed + 1, dtype=torch.bfloat16 if xbf16 else torch.float32)
    big = linear_w4(x, packed, s, mins, None, n, 32)
    for r0 in range(0, m - 4, 5):
        assert torch.equal(linear_w4(x[r0:r0 + 5], packed, s, mins, None, n, 32), big[r0:r0 + 5]), r0


def test_linear_w4_decode_rows_agree_with_tile_path():
    """Row r of an M <= 4 call (direct path) equals row r of an M = 9 call (tile path) within fp32 reordering."""
    from fxcompiler.ops.quant_linear import linear_w4

    packed, s, mins = _w4_problem(9, 576, 200, 32, 7)
    x = _rand(9, 576, seed=8)
    big = linear_w4(x, packed, s, mins, None, 200, 32)
    for m in (1, 2, 3, 4):
        torch.testing.assert_close(linear_w4(x[:m], packed, s, mins, None, 200, 32), big[:m], rtol=1e-5, atol=1e-5)


_W4_PATHS_CODE = """
    import torch
    import backends.cpu.quant as quant
    from fxcompiler.ops.quant_linear import (dequantize_linear_weight_int4, linear_w4, pack_int4,
                                             quantize_linear_weight_int4, unpack_int4)
    torch.manual_seed(0)
    for m, k, n, gs in [(1, 78, 50, 32), (2, 64, 70, 32), (3, 130, 33, 64), (4, 576, 40, 32), (5, 64, 33, 32),
                        (70, 96, 40, 128), (1, 192, 700, 32), (2, 64, 300, 32)]:  # the last two: several streams
        w, x, b = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
        q, s, mn = quantize_linear_weight_int4(w, gs)
        wd = dequantize_linear_weight_int4(q, s, mn, n, gs).double()
        y = linear_w4(x, q, s, mn, b, n, gs)
        torch.testing.assert_close(y.double(), x.double() @ wd.T + b.double(), rtol=1e-4, atol=1e-4)
        qc, sc, mc = unpack_int4(q, s, mn, n)  # the same values with fp16 scales and mins: the same output
        qc, sc, mc = pack_int4(qc, sc.half().float(), mc.half().float(), gs, compact=True)
        wide = pack_int4(*unpack_int4(qc, sc.float(), mc.float(), n), gs)
        assert sc.dtype == torch.float16 and torch.equal(linear_w4(x, qc, sc, mc, b, n, gs), linear_w4(x, *wide, b, n, gs))
    print("OK", quant.isa())
"""


@pytest.mark.skipif(not _build.can_build() or _build.detect_isa() != "avx512",
                    reason="needs the AVX-512 machine to also exercise the AVX2 build")
def test_linear_w4_avx2_build_matches_reference():
    r = _run_py(_W4_PATHS_CODE, {"FXCOMPILER_CPU_ISA": "avx2"})
    assert r.returncode == 0 and "OK avx2" in r.stdout, r.stdout + r.stderr
