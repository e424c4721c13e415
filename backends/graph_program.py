"""The fx backend's native executor: a supertask plan of fx GraphModules flattened into one C++ program.

A decode step of SmolLM2 is ~700 operator calls (32 supertasks); called from the graphs' generated
Python code each costs ~3 us of interpreter and argument parsing around a kernel that may itself
take 2 us (measured: ~3.5 ms of a 12 ms bf16 batch-1 step). :func:`compile_plan` turns the plan
into a ``GraphProgram`` (``csrc/graph_program.cpp``): every fx node becomes one instruction that
calls the node's operator through the c10 dispatcher with a boxed stack of slot values and
constants, arguments normalised against the schema at build time (keyword-only ones and
defaults included); ``operator.getitem`` of multi-output ops and integer arithmetic on sizes
are instructions too; each slot is dropped after its last reader, as the Python plan frees
intermediates. A step is then one call that runs with the GIL released. An operator's error keeps its
type and says which node raised it (``... (in graph node supertask3/view_default (aten::view))``,
supertasks numbered in execution order). Semantics are the
graph's: the same operators, in the same order, on the same values (kernels registered in
Python still run; the dispatcher takes the GIL for them).

Graphs with anything else (``call_module``, higher-order ops, Python functions) raise
:class:`UnsupportedGraph` and the fx executor keeps its Python plan. Set
``FXCOMPILER_NATIVE_EXECUTOR=0`` to always use the Python plan (e.g. to step through the
generated code); without a C++ compiler the module cannot be built and the Python plan runs
with one warning.
"""
from __future__ import annotations

import operator
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

_SOURCE = Path(__file__).resolve().parent / "csrc" / "graph_program.cpp"
_lock = threading.Lock()
_state: dict = {"module": None, "tried": False, "error": None}

_ARITH = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.floordiv: "floordiv",
          operator.mod: "mod"}


class UnsupportedGraph(Exception):
    """A graph node the native executor cannot run (the fx executor then uses its Python plan)."""


def enabled() -> bool:
    """False when ``FXCOMPILER_NATIVE_EXECUTOR`` is ``0``/``false``/``off``."""
    return os.environ.get("FXCOMPILER_NATIVE_EXECUTOR", "1").strip().lower() not in ("0", "false", "off", "no")


def program_module():
    """The compiled extension module (built on first use into the kernel cache), or None with one warning."""
    from .cpu import _build

    return _build.load_once(_state, _lock, _load, "fxcompiler native graph executor unavailable, graphs run "
                            "through their Python code")


def _load():
    from .cpu import _build

    flags = ["-O2"]
    return _build.load_extension(f"fxc_graph_program_{_build.source_digest([_SOURCE], flags)}", [_SOURCE], flags)


class _Builder:
    """Collects instructions over a flat slot space; frees are computed once all reads are known."""

    def __init__(self, num_user_inputs: int):
        self.num_slots = num_user_inputs
        self.constants: dict[int, Any] = {}
        self._const_slot: dict[int, int] = {}
        self.code: list[tuple] = []  # (kind, payload, reads, writes)

    def new_slot(self) -> int:
        self.num_slots += 1
        return self.num_slots - 1

    def constant(self, value: torch.Tensor) -> int:
        key = id(value)
        if key not in self._const_slot:
            self._const_slot[key] = s = self.new_slot()
            self.constants[s] = value
        return self._const_slot[key]

    def emit(self, kind: str, payload: tuple, reads: set[int], writes: list[int]) -> None:
        self.code.append((kind, payload, reads, writes))


def _arg_spec(value, env: dict, reads: set[int], label: str):
    if isinstance(value, torch.fx.Node):
        if value not in env or not isinstance(env[value], int):
            raise UnsupportedGraph(f"{label}: reads {value.name}, which has no single value")
        reads.add(env[value])
        return ("slot", env[value])
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.fx.Node) for v in value):
        return ("list", [_arg_spec(v, env, reads, label) for v in value])
    if isinstance(value, (list, tuple)):  # fx's immutable_list, or a tuple where the schema wants a list
        value = list(value)
    if isinstance(value, torch.Tensor):
        raise UnsupportedGraph(f"{label}: tensor constant in the arguments")
    return ("const", value)


def _add_graph(b: _Builder, gm: torch.fx.GraphModule, inputs: Sequence[int], label: str) -> list[int]:
    """Append one graph's nodes; ``inputs`` are the slots of its placeholders. Returns its output slots."""
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise UnsupportedGraph(f"{label}: {len(placeholders)} placeholders, {len(inputs)} inputs")
    env.update(zip(placeholders, inputs))
    for node in gm.graph.nodes:
        where = f"{label}/{node.name}"
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            if not isinstance(value, torch.Tensor):
                raise UnsupportedGraph(f"{where}: attribute {node.target} is not a tensor")
            env[node] = b.constant(value)
        elif node.op == "output":
            outs = node.args[0]
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            result = []
            for o in outs:
                if not isinstance(o, torch.fx.Node) or not isinstance(env.get(o), int):
                    raise UnsupportedGraph(f"{where}: graph output {o!r} is not a single value")
                result.append(env[o])
            return result
        elif node.op != "call_function":
            raise UnsupportedGraph(f"{where}: {node.op} nodes are not supported")
        elif isinstance(node.target, torch._ops.OpOverload):
            _add_op(b, node, env, where)
        elif node.target is operator.getitem:
            src, index = node.args
            value = env.get(src)
            if isinstance(value, tuple):  # multi-return op: each return has its slot already
                env[node] = value[index]
            elif isinstance(value, int) and isinstance(index, int):  # list-returning op (split, unbind...)
                env[node] = dst = b.new_slot()
                b.emit("getitem", (value, index, dst, where), {value}, [dst])
            else:
                raise UnsupportedGraph(f"{where}: getitem of {src}")
        elif node.target in _ARITH and len(node.args) == 2 and not node.kwargs:
            reads: set[int] = set()
            a, c = (_arg_spec(x, env, reads, where) for x in node.args)
            if any(s[0] == "const" and not isinstance(s[1], int) for s in (a, c)):
                raise UnsupportedGraph(f"{where}: non-integer arithmetic")
            env[node] = dst = b.new_slot()
            b.emit("arith", (_ARITH[node.target], a, c, dst, where), reads, [dst])
        else:
            raise UnsupportedGraph(f"{where}: call of {node.target!r} is not an operator overload")
    raise UnsupportedGraph(f"{label}: graph has no output node")


def _add_op(b: _Builder, node: torch.fx.Node, env: dict, where: str) -> None:
    op: torch._ops.OpOverload = node.target
    schema = op._schema
    reads: set[int] = set()
    args = []
    positional = list(node.args)
    for i, formal in enumerate(schema.arguments):
        if i < len(positional) and not formal.kwarg_only:
            args.append(_arg_spec(positional[i], env, reads, where))
        elif formal.name in node.kwargs:
            args.append(_arg_spec(node.kwargs[formal.name], env, reads, where))
        elif formal.has_default_value():
            args.append(("default", None))
        else:
            raise UnsupportedGraph(f"{where}: argument {formal.name!r} of {op} is missing")
    if len(positional) > len(schema.arguments) or set(node.kwargs) - {a.name for a in schema.arguments}:
        raise UnsupportedGraph(f"{where}: arguments do not match {schema}")
    outs = [b.new_slot() for _ in schema.returns]
    env[node] = outs[0] if len(outs) == 1 else tuple(outs)
    name, overload = schema.name, schema.overload_name
    b.emit("op", (name, overload, args, outs, where), reads, outs)


def compile_plan(steps: Sequence[tuple[torch.fx.GraphModule, Sequence[torch.Tensor], Sequence[int], Sequence[int]]],
                 num_user_inputs: int, out_slot: int):
    """One ``GraphProgram`` for a plan of supertasks over named slots (the fx executor's): each step is
    ``(graph module, bound parameter tensors, input slots, output slots)``; slots ``< num_user_inputs`` are
    the caller's inputs; ``out_slot`` names the result. Raises :class:`UnsupportedGraph`."""
    mod = program_module()
    if mod is None:
        raise UnsupportedGraph("the native executor module is not available")
    b = _Builder(num_user_inputs)
    where = {i: i for i in range(num_user_inputs)}  # plan slot -> program slot
    for k, (gm, bound, ins, outs) in enumerate(steps):
        inputs = [b.constant(t) for t in bound] + [where[i] for i in ins]
        results = _add_graph(b, gm, inputs, f"supertask{k}")
        if len(results) != len(outs):
            raise UnsupportedGraph(f"supertask{k}: {len(results)} outputs, plan expects {len(outs)}")
        where.update(zip(outs, results))
    final = where[out_slot]
    keep = set(range(num_user_inputs)) | set(b.constants) | {final}
    last_read: dict[int, int] = {}
    for i, (_, _, reads, _) in enumerate(b.code):
        for s in reads:
            last_read[s] = i
    dies_at: dict[int, list[int]] = {}
    for s, i in last_read.items():
        if s not in keep:
            dies_at.setdefault(i, []).append(s)
    prog = mod.GraphProgram(b.num_slots)
    for s, t in b.constants.items():
        prog.set_constant(s, t)
    prog.set_inputs(list(range(num_user_inputs)))
    prog.set_outputs([final])
    for i, (kind, payload, _, writes) in enumerate(b.code):
        frees = sorted(s for s in set(writes) if s not in keep and s not in last_read)  # never read
        frees += sorted(dies_at.get(i, ()))
        if kind == "op":
            name, overload, args, outs, label = payload
            prog.add_op(name, overload, args, outs, frees, label)
        elif kind == "getitem":
            src, index, dst, label = payload
            prog.add_getitem(src, index, dst, frees, label)
        else:
            op, a, c, dst, label = payload
            prog.add_arith(op, a, c, dst, frees, label)
    return prog
