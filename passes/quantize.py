"""``quantize``: parameter matmuls become weight-only quantized ops on weights packed at build time.

Requires: ``weight_layout`` and ``fuse_projections`` have run (matmuls read ``[K, N]`` parameters named
``W.T`` or ``A.T+B.T+...`` for fused projections); runs before ``lower_cpu_kernels`` (which only
lowers the float matmuls left over). Reads ``ctx.options["quantization"]`` (a JSON-able dict, part of
the compile-cache key), absent or None = nothing to do:

* ``weight``: ``"rules"`` → per-module schemes from a qformat (``rules``: ``[[pattern, scheme], ...]``,
  first fnmatch on transformers' module name wins, ``default`` for the rest; the output projection
  only when a pattern names it; a pattern that matches no matmul raises), with ``qparam``
  (``{"path", "sha256"}``, :mod:`fxcompiler.qparam`) giving the scales/mins (and optionally the
  codes): missing, extra or misshapen tensors raise naming the tensor; ``"int8"`` → ``fxc::linear_w8`` (symmetric, per-channel when ``group_size`` is -1, else
  per group of ``group_size`` along K, which must divide K); ``"int4"`` → ``fxc::linear_w4``
  (asymmetric scale + min per group of ``group_size``, default 128; a shorter last group is allowed);
  ``"fp8"`` → ``fxc::linear_f8`` (e4m3 codes, one scale ``amax / 448`` per output channel);
  ``"native"`` → only the checkpoint's own quantized tensors (``gguf``), everything else kept;
* ``activation``: ``"fp8"`` (Wf8Af8) → the fp8 matmuls become ``fxc::linear_f8f8`` (per-token e4m3 activations;
  any other weight raises). ``"int8"`` (W8A8) → the int8 per-channel matmuls become ``fxc::linear_w8a8`` (per-token
  dynamic int8 activations; an int8 group size or fp8 with it raises), and the int4 ones, a GGUF's native int4
  blocks included, ``fxc::linear_w4a8`` (W4A8: int8 activations per token and weight group; K and the group
  multiples of 8, else it raises); a GGUF's native int8 blocks stay weight-only. ``smoothquant``: the qparam
  must carry ``M.smooth_factor`` ``[K]`` for every quantized module (recorded and checked, positive and finite;
  ``fxcompiler quantize`` has already folded them into the float weights it writes, :mod:`fxcompiler.smoothquant`);
* ``symmetric`` (int4 only): Q4_0-style codes instead of Q4_1-style;
* ``lm_head``: ``True``: also quantize the output projection (the tied embedding's ``lm_head``) to int8 —
  per channel, or the GGUF's own blocks of the embedding (Q8_0, Q6_K, Q4_K, ...), as llama.cpp computes it;
  ``"native"``: only from the GGUF's own blocks (exactly the checkpoint's weights), else kept; otherwise
  kept in float (it is the most sensitive matmul);
* ``gguf``: ``{"path": ..., "num_heads": H, "num_kv_heads": Hkv}``: use the GGUF's Q4_0/Q4_1/Q4_K
  (int4) and Q8_0/Q5_0/Q6_K (int8) blocks as they are (:mod:`fxcompiler.models.gguf_quant`) for every
  matmul whose parameters all have one of the same layout, and check that they dequantise bit-exactly
  to the float parameter transformers made of them (a mismatch raises: it would mean a wrong name or
  row mapping); the rest stays in float, logged with the reason.

Ensures: each rewritten matmul (``+ bias``) computes ``x @ dequant(Wq)`` with fp32 accumulation; with
``gguf`` that is exactly the captured float weight, so the function is unchanged up to accumulation
order; with RTN the weight error per value is at most half a quantization step (scale/2; fp8: half an e4m3 ulp,
``max(|w|/16, scale/1024)``).
Signature: each rewritten weight ``W`` becomes parameter inputs ``<W>.q``, ``<W>.scales`` (and
``<W>.mins`` for int4, W4A8 too; W8A8: ``<W>.q``, ``<W>.scales``, ``<W>.sums``); ``W`` is dropped unless something else reads it.
With ``gguf``, an ``aten.embedding`` of an fp32 table the GGUF holds natively (a tied ``token_embd``) becomes
``fxc::embedding_w8`` / ``fxc::embedding_w4`` over the table's blocks in the linear layouts (the output
projection's own tensors when it runs on them, else ``<table>.q`` ...), checked exact like the matmuls; no
fp32 copy of a quantized table survives the pass.
"""
from __future__ import annotations

import logging

import torch
from torch.fx import GraphModule

from fxcompiler.ops.linear import NB, _pad_rows, _panels, quantize_linear_weight_int8
from fxcompiler.ops.w8a8_linear import pack_w8a8, quantize_w8a8_weight
from fxcompiler.ops.quant_linear import (pack_fp8, pack_int4, quantize_linear_weight_fp8, quantize_linear_weight_int4,
                                         unpack_int4)
from fxcompiler.ops.w4a8_linear import pack_w4a8
from fxcompiler.param_memory import HeapTrimmer
from fxcompiler.pass_manager import CompileContext, PassError, PassResult, register_pass
from fxcompiler.qparam import QParamSet as _QParams

from .lower_cpu_kernels import _match

log = logging.getLogger("fxcompiler.passes")

_HEAD_WORDS = ("lm_head", "embed_tokens", "wte", "embed_out", "output.weight")
_CHECK_ROWS = 4096  # rows of a GGUF tensor dequantised at a time by the exactness check


def _sources(target: str) -> list[str]:
    """The original parameter names behind a (fused, transposed) parameter name."""
    return [p.removesuffix(".T") for p in target.split("+")]


def _native_name(name: str, tensors: dict) -> str:
    """The checkpoint tensor name of a captured parameter: the capture may prefix the module path
    (``model.model.layers...``); a tied ``lm_head`` is the embedding (GGUF stores ``token_embd`` only)."""
    parts = name.split(".")
    for i in range(len(parts)):
        cand = ".".join(parts[i:])
        if cand in tensors:
            return cand
        if cand == "lm_head.weight" and "model.embed_tokens.weight" in tensors:
            return "model.embed_tokens.weight"
    return name


def _log_dequantised(skipped: dict[str, str], mixed: dict[str, str]) -> None:
    """Say which GGUF tensors run dequantised, and why (the pass keeps their float copies)."""
    by_reason: dict[str, int] = {}
    for reason in skipped.values():
        by_reason[reason] = by_reason.get(reason, 0) + 1
    for reason, count in sorted(by_reason.items()):
        log.info("quantize: %d GGUF tensor(s) kept dequantised: %s", count, reason)
    if mixed:
        target, types = next(iter(mixed.items()))
        log.info("quantize: %d fused matmul(s) kept dequantised: their GGUF tensors have different layouts "
                 "(e.g. %s: %s)", len(mixed), target, types)


def _module_name(param: str) -> str:
    """transformers' module name of a captured parameter (the capture wraps the model as ``model.``)."""
    name = param.removesuffix(".weight")
    if name.startswith("model.") and name[6:].split(".")[0] in ("model", "lm_head", "transformer", "gpt_neox",
                                                                  "embed_out"):
        name = name[6:]
    return name


def _rules(cfg: dict, weight: str) -> tuple[list, dict]:
    """``(rules, default scheme)`` of the pass options (a qformat's, or one global scheme)."""
    if weight == "rules":
        return [tuple(r) for r in cfg.get("rules", [])], dict(cfg.get("default") or {"weight": "keep"})
    if weight == "native":
        return [], {"weight": "keep"}
    group = int(cfg.get("group_size", 128 if weight == "int4" else -1))
    return [], {"weight": weight, "group_size": group, "symmetric": bool(cfg.get("symmetric", weight == "int8"))}


def _is_head(names: list[str]) -> bool:
    return any(w in n for n in names for w in _HEAD_WORDS)


def pack_int8_codes(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pack int8 codes ``[N, K]`` with per-group scales ``[N, G]`` (G = K / group) for ``fxc::linear_w8``."""
    n, k = q.shape
    g = scales.shape[1]
    p = _panels(n)
    packed = _pad_rows(q.to(torch.int8), p * NB).reshape(p, NB, k).permute(0, 2, 1).contiguous()
    if g == 1:
        return packed, _pad_rows(scales[:, 0].float(), p * NB).contiguous(), -1
    lay = _pad_rows(scales.float(), p * NB).reshape(p, NB, g).permute(0, 2, 1).contiguous()
    return packed, lay, k // g


@register_pass("quantize")
class QuantizePass:
    def __init__(self, config: dict | None = None):
        self.config = config

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        cfg = self.config if self.config is not None else ctx.options.get("quantization")
        self._cfg = cfg or {}
        if not cfg:
            return PassResult(gm, False, {"quantized": 0})
        weight = cfg.get("weight", "int8")
        if weight not in ("int8", "int4", "fp8", "native", "rules"):
            raise PassError(f"quantize: weight must be 'int8', 'int4', 'fp8', 'native' or 'rules', got {weight!r}")
        rules, default = _rules(cfg, weight)
        native = None
        if cfg.get("gguf"):
            from fxcompiler.models.gguf_quant import read_native

            g = cfg["gguf"]
            native = read_native(g["path"], g.get("num_heads"), g.get("num_kv_heads"))
        qparam = _QParams(cfg["qparam"]["path"]) if cfg.get("qparam") else None
        graph = gm.graph
        sites = [s for node in list(graph.nodes) if (s := _match(node, ctx)) is not None and s.transposed]
        packed: dict[str, tuple] = {}
        self._by_native: dict[str, tuple] = {}  # checkpoint tensor name -> its packed op (a tied table shares it)
        matched: set[int] = set()
        seen: set[str] = set()
        trimmer = HeapTrimmer()
        info = {"quantized": 0, "kept": 0, "native": 0, "rtn": 0, "exact_checked": 0, "ops": {}, "weight_bytes": 0}
        for site in sites:
            target = ctx.placeholder_spec(site.w).target
            names = _sources(target)
            seen.update(_module_name(n) for n in names)
            if target not in packed:
                scheme = self._scheme(names, rules, default, cfg, matched)
                packed[target] = self._pack(gm, ctx, site, target, names, scheme, native, qparam, info, cfg)
            op = packed[target]
            if op is None:
                info["kept"] += 1
                continue
            kind, args = op
            with graph.inserting_before(site.out):
                if kind in ("w4", "w4a8"):
                    q, s, m, gs = args
                    op4 = torch.ops.fxc.linear_w4.default if kind == "w4" else torch.ops.fxc.linear_w4a8.default
                    new = graph.call_function(op4, (site.x, q, s, m, site.bias, site.n, gs))
                elif kind == "w8a8":
                    q, s, su = args
                    new = graph.call_function(torch.ops.fxc.linear_w8a8.default, (site.x, q, s, su, site.bias, site.n))
                elif kind == "f8":
                    q, s = args
                    new = graph.call_function(torch.ops.fxc.linear_f8.default, (site.x, q, s, site.bias, site.n))
                elif kind == "f8f8":
                    q, s = args
                    new = graph.call_function(torch.ops.fxc.linear_f8f8.default, (site.x, q, s, site.bias, site.n))
                else:
                    q, s, gs = args
                    new = graph.call_function(torch.ops.fxc.linear_w8.default, (site.x, q, s, site.bias, site.n, gs))
            new.meta["val"] = site.out.meta.get("val")
            site.out.replace_all_uses_with(new)
            for node in site.erase:
                graph.erase_node(node)
            if ctx.drop_param_if_unused(gm, site.w):  # the float weight and packing temporaries back to the OS
                trimmer.replaced(site.k * site.n * 4)
            info["quantized"] += 1
            info["ops"][kind] = info["ops"].get(kind, 0) + 1
        unmatched = [p for i, (p, _) in enumerate(rules) if i not in matched]
        if unmatched:
            mods = sorted(seen)
            raise ValueError(f"quantize: qformat module pattern {unmatched[0]!r} matches no matmul of the model "
                            f"(modules: {', '.join(mods[:6])}{', ...' if len(mods) > 6 else ''})")
        if qparam is not None:
            qparam.check_all_used()
        if native is not None:
            self._native_embeddings(gm, ctx, native, info)
        info["dropped_params"] = ctx.drop_unused_params(gm)
        if native is not None:
            info["gguf_skipped"] = dict(native.skipped)
            _log_dequantised(native.skipped, info.get("gguf_mixed", {}))
        log.info("quantize: %d matmuls quantized (%d from the checkpoint's blocks, %d RTN), %d kept",
                 info["quantized"], info["native"], info["rtn"], info["kept"])
        return PassResult(gm, info["quantized"] > 0, info)

    # ------------------------------------------------------------------------------------------------
    @staticmethod
    def _scheme(names, rules, default, cfg, matched) -> dict:
        """One scheme for a (fused) matmul; every fused module must resolve to the same one."""
        from fxcompiler.qformat import match_rule

        schemes = []
        for name in names:
            mod = _module_name(name)
            head = _is_head([name])
            idx, scheme = match_rule(mod, rules, None if head else default)
            if idx is not None:
                matched.add(idx)
            if scheme is None:  # the output projection: kept unless named (or lm_head=True / "native")
                lm_head = cfg.get("lm_head")
                scheme = {"weight": "int8", "group_size": -1, "symmetric": True} if lm_head is True \
                    else {"weight": "keep", "native_only": True} if lm_head == "native" else {"weight": "keep"}
            schemes.append(dict(scheme, head=head))
        if any({k: v for k, v in s.items() if k != "head"} != {k: v for k, v in schemes[0].items() if k != "head"}
               for s in schemes):
            raise ValueError("quantize: the qformat gives different schemes to modules fused into one matmul ("
                            + ", ".join(_module_name(n) for n in names) + "); give them one scheme")
        return schemes[0]

    def _pack(self, gm, ctx, site, target, names, scheme, native, qparam, info, cfg):
        w_kn = ctx.param_of(site.w)
        head = scheme["head"]
        if head and scheme["weight"] == "keep" and not scheme.get("native_only"):
            return None
        from_ckpt = None
        if native is not None:
            names = [_native_name(n, native.tensors) for n in names]
        if native is not None and all(n in native.tensors for n in names):
            parts = [native.tensors[n] for n in names]
            if len({(p.bits, p.group) for p in parts}) == 1:
                from_ckpt = parts
            else:  # e.g. Q4_K_M's Q4_K q/k beside a Q6_K v, fused into one matmul: one layout cannot hold both
                info.setdefault("gguf_mixed", {})[target] = "+".join(p.gguf_type for p in parts)
        if from_ckpt is not None:
            exact = self._check_exact(from_ckpt, w_kn, target)
            info["exact_checked"] += exact
            info["native"] += 1
            op = self._pack_native(gm, ctx, target, from_ckpt, info)
            if len(names) == 1:
                self._by_native[names[0]] = op
            return op
        weight = scheme["weight"]
        if weight == "keep" or w_kn.dtype not in (torch.float32, torch.bfloat16):
            return None
        w = w_kn.t()  # [N, K] view
        group = int(scheme.get("group_size", -1))
        if weight == "int4" and group == -1:
            group = site.k  # one group per row
        a8 = self._w8a8(cfg, weight, group, target)
        f8_kind = "f8f8" if self._f8f8(cfg, weight, target) else "f8"
        if qparam is not None:
            codes, scales, mins = qparam.codes_for([_module_name(n) for n in names], w, weight, group,
                                                   bool(scheme.get("symmetric", weight == "int8")))
            info["from_qparam"] = info.get("from_qparam", 0) + 1
            if a8:
                if cfg.get("smoothquant"):
                    qparam.smooth_factors([_module_name(n) for n in names], site.k)
                if codes.numel() and int(codes.min()) < -127:
                    raise PassError(f"quantize: the qparam's int8 codes of {', '.join(_module_name(n) for n in names)} "
                                    "include -128; W8A8 (fxc::linear_w8a8) takes codes in [-127, 127]")
                return "w8a8", self._add(gm, ctx, target, info, **dict(zip(("q", "scales", "sums"),
                                                                           pack_w8a8(codes, scales))))
            if weight == "fp8":
                q, s = pack_fp8(codes, scales)
                return f8_kind, self._add(gm, ctx, target, info, q=q, scales=s)
            if weight == "int4":
                return self._int4(gm, ctx, target, info, cfg, codes, scales, mins, group)
            q, s, gs = pack_int8_codes(codes, scales)
            return "w8", self._add(gm, ctx, target, info, q=q, scales=s) + (gs,)
        info["rtn"] += 1
        if weight == "fp8":
            if group != -1:
                raise PassError(f"quantize: fp8 weights have one scale per output channel, got group_size={group}")
            q, s = quantize_linear_weight_fp8(w)
            return f8_kind, self._add(gm, ctx, target, info, q=q, scales=s)
        if weight == "int4":
            q, s, m = unpack_int4(*quantize_linear_weight_int4(w, group, bool(scheme.get("symmetric", False))), site.n)
            return self._int4(gm, ctx, target, info, cfg, q, s, m, group)
        if group > 0 and site.k % group:
            raise PassError(f"quantize: int8 group_size={group} does not divide K={site.k} of {target!r}; use a "
                            "divisor of K or -1 (per channel)")
        if a8:
            return "w8a8", self._add(gm, ctx, target, info, **dict(zip(("q", "scales", "sums"),
                                                                       quantize_w8a8_weight(w))))
        q, s = quantize_linear_weight_int8(w, group)
        return "w8", self._add(gm, ctx, target, info, q=q, scales=s) + (group,)

    def _pack_native(self, gm, ctx, target, parts, info) -> tuple:
        """``(kind, args)`` of checkpoint blocks (fused parts concatenated row-wise) in the linear ops' layouts."""
        codes = torch.cat([p.codes for p in parts], 0)
        scales = torch.cat([p.scales for p in parts], 0)
        if parts[0].bits == 4:
            mins = torch.cat([p.mins for p in parts], 0)
            return self._int4(gm, ctx, target, info, self._cfg, codes, scales, mins, parts[0].group)
        q, s, gs = pack_int8_codes(codes, scales)
        return "w8", self._add(gm, ctx, target, info, q=q, scales=s) + (gs,)

    def _int4(self, gm, ctx, target, info, cfg, codes, scales, mins, group) -> tuple:
        """``(kind, args)`` of int4 codes ``[N, K]`` with scales/mins ``[N, G]``: ``fxc::linear_w4``, or
        ``fxc::linear_w4a8`` under int8 activations (``activation: int8``; K and the group multiples of 8)."""
        if cfg.get("activation") == "int8":
            if codes.shape[1] % 8 or group % 8:
                raise PassError(f"quantize: W4A8 (fxc::linear_w4a8) needs K and the group size multiples of 8; "
                                f"{target!r} has K={codes.shape[1]}, group_size={group}")
            q, s, m = pack_w4a8(codes, scales, mins, group, compact=True)
            return "w4a8", self._add(gm, ctx, target, info, q=q, scales=s, mins=m) + (group,)
        q, s, m = pack_int4(codes, scales, mins, group, compact=True)
        return "w4", self._add(gm, ctx, target, info, q=q, scales=s, mins=m) + (group,)

    def _native_embeddings(self, gm, ctx, native, info) -> None:
        """Embedding lookups of a checkpoint's quantized table read its blocks (``fxc::embedding_w8`` /
        ``fxc::embedding_w4``, only the gathered rows dequantised) instead of the fp32 table: for a tied table
        the same tensors as the output projection when that runs on the blocks too. The table must dequantise
        bit for bit to the captured fp32 parameter (else ``PassError``); a bf16 one (rounded) stays."""
        graph = gm.graph
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not torch.ops.aten.embedding.default:
                continue
            w_node, ids = node.args[0], node.args[1]
            w = ctx.param_of(w_node) if isinstance(w_node, torch.fx.Node) else None
            if w is None or w.dtype != torch.float32 or w.dim() != 2:
                continue
            target = ctx.placeholder_spec(w_node).target
            name = _native_name(target, native.tensors)
            if name not in native.tensors:
                continue
            if name not in self._by_native:
                part = native.tensors[name]
                info["exact_checked"] += self._check_exact([part], w.t(), target)
                self._by_native[name] = self._pack_native(gm, ctx, target, [part], info)
            kind, args = self._by_native[name]
            if kind == "w4a8":  # the tied output's blocks are in W4A8's layout; the lookup reads fxc::linear_w4's
                part = native.tensors[name]
                kind, args = self._int4(gm, ctx, f"{target}.lookup", info, {}, part.codes, part.scales, part.mins,
                                        part.group)
            op = torch.ops.fxc.embedding_w4.default if kind == "w4" else torch.ops.fxc.embedding_w8.default
            with graph.inserting_before(node):
                new = graph.call_function(op, (ids, *args[:-1], int(w.shape[0]), args[-1]))
            new.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            ctx.drop_param_if_unused(gm, w_node)
            info["embeddings"] = info.get("embeddings", 0) + 1

    @staticmethod
    def _w8a8(cfg: dict, weight: str, group: int, target: str) -> bool:
        """True when this matmul takes int8 activations (``activation: int8``); raises for a scheme W8A8 lacks."""
        if cfg.get("activation") != "int8" or weight == "int4":  # int4: W4A8, :meth:`_int4`
            return False
        if weight != "int8":
            raise PassError(f"quantize: int8 activations need int8 (W8A8) or int4 (W4A8) weights, {target!r} has "
                            f"{weight}")
        if group != -1:
            raise PassError(f"quantize: W8A8 weights have one scale per output channel, {target!r} has "
                            f"group_size={group}")
        return True

    @staticmethod
    def _f8f8(cfg: dict, weight: str, target: str) -> bool:
        """True when this matmul takes per-token fp8 activations (``activation: fp8``, Wf8Af8); raises unless its
        weight is fp8."""
        if cfg.get("activation") != "fp8":
            return False
        if weight != "fp8":
            raise PassError(f"quantize: fp8 activations (Wf8Af8) need fp8 weights, {target!r} has {weight}")
        return True

    @staticmethod
    def _add(gm, ctx, target, info, **tensors) -> tuple:
        out = []
        for suffix, value in tensors.items():
            info["weight_bytes"] += value.numel() * value.element_size()
            out.append(ctx.add_param_input(gm, f"{target}.{suffix}", value))
        return tuple(out)

    @staticmethod
    def _check_exact(parts, w_kn: torch.Tensor, target: str) -> int:
        """The checkpoint's blocks must dequantise to the float parameter bit for bit (compared
        :data:`_CHECK_ROWS` rows at a time: no fp32 copy of a whole table is made)."""
        if w_kn.dtype != torch.float32:
            return 0  # a bf16 model was rounded after dequantisation; nothing exact to compare
        ref = w_kn.t()  # [N, K]
        if sum(p.codes.shape[0] for p in parts) != ref.shape[0] or any(p.codes.shape[1] != ref.shape[1] for p in parts):
            raise PassError(f"quantize: the GGUF blocks of {target!r} have another shape than the captured weight "
                            f"{tuple(ref.shape)} (wrong tensor mapping)")
        row = 0
        for p in parts:
            n = p.codes.shape[0]
            for lo in range(0, n, _CHECK_ROWS):
                hi = min(n, lo + _CHECK_ROWS)
                # value equality (Q4_0's d·(q−8) gives −0.0 where d·q − 8d gives +0.0; every other bit is equal)
                if not torch.equal(p.dequantize(slice(lo, hi)), ref[row + lo:row + hi]):
                    raise PassError(f"quantize: the GGUF blocks of {target!r} do not dequantise to the captured "
                                    "weight (wrong tensor mapping or row permutation)")
            row += n
        return 1
