"""``fx`` backend: run a pipeline of ATen GraphModule supertasks eagerly on cpu or cuda.

The executable binds the pipeline's parameter tensors once (moved to the device), so a
step costs one Python call into the generated graph code per supertask plus the ATen
ops (one call in all for a single-supertask pipeline).
"""
from __future__ import annotations

import operator

import torch

from fxcompiler.ops import paged_attention  # noqa: F401  (the graph calls fxc::paged_attention)
from fxcompiler.pipeline import ParamInfo, Pipeline, SuperTaskKind

from . import graph_program, register_backend


class FxExecutable:
    """Callable ``(*user_inputs) -> logits`` for a pipeline of fx compute supertasks.

    One supertask (the whole graph): a call is one Python call into the generated code.
    Several (blockwise: embedding, blocks, head): the supertasks run in topological order
    over a flat list of value slots (user inputs first, then the named intermediates);
    everything is resolved at construction into a tuple of ``(forward, bound params,
    input slots, output slots, slots to clear)``, so a step is a tight loop with no
    lookups by name. Supertasks that share a blob call the same GraphModule. Parameters
    are moved to the device once, each tensor once however many supertasks read it (tied
    embeddings). KV caches are user inputs that ``fxc::paged_attention`` updates in place.

    ``native=True`` (the CPU backend) flattens that plan into one ``GraphProgram``
    (:mod:`backends.graph_program`): a call is then one C++ loop of dispatcher calls with the GIL
    released, the same operators in the same order. ``executor`` says which runs;
    ``fallback_reason`` why the Python plan does (an unsupported node, switched off, no compiler).
    """

    def __init__(self, pipeline: Pipeline, params: dict[str, torch.Tensor], device: torch.device,
                 native: bool = False):
        self.device = device
        comps = pipeline.compute_supertasks()
        if not comps or any(t.kind is not SuperTaskKind.FX for _, t in comps):
            raise NotImplementedError("the fx executor runs pipelines of fx compute supertasks only")
        inputs = [t for t in pipeline.supertasks.values() if t.kind is SuperTaskKind.INPUT]
        outputs = [t for t in pipeline.supertasks.values() if t.kind is SuperTaskKind.OUTPUT]
        on_device: dict[str, torch.Tensor] = {}

        def bind(info: ParamInfo) -> torch.Tensor:
            key = info.value.name
            if key not in on_device:
                on_device[key] = params[key].to(device)
            return on_device[key]

        tasks = _topological(comps)
        user_names = list(inputs[0].outputs) if inputs else [n for n in tasks[0].inputs
                                                              if not isinstance(pipeline.tensors[n], ParamInfo)]
        slot = {name: i for i, name in enumerate(user_names)}
        self.user_inputs = user_names
        plan = []
        for task in tasks:
            bound, ins = [], []
            for name in task.inputs:
                info = pipeline.tensors.get(name)
                if isinstance(info, ParamInfo):
                    if ins:
                        raise ValueError("parameter inputs must precede the other inputs of a supertask")
                    bound.append(bind(info))
                else:
                    if name not in slot:
                        raise ValueError(f"supertask input {name!r} is produced by no earlier supertask")
                    ins.append(slot[name])
            outs = []
            for name in task.outputs:
                slot[name] = len(slot)
                outs.append(slot[name])
            plan.append([pipeline.blobs[task.data_blob].graph, tuple(bound), tuple(ins), tuple(outs)])
        final = outputs[0].inputs[0] if outputs else tasks[-1].outputs[0]
        self._out_slot = slot[final]
        # Free each intermediate after its last reader (user inputs stay the caller's).
        last_use = {}
        for i, (_, _, ins, _) in enumerate(plan):
            for s in ins:
                last_use[s] = i
        for i, step in enumerate(plan):
            step.append(tuple(s for s, j in last_use.items() if j == i and s >= len(user_names)
                              and s != self._out_slot))
        self.graph_modules = list(dict.fromkeys(step[0] for step in plan))
        self.graph_module = self.graph_modules[0] if len(plan) == 1 else None
        self._plan = tuple((step[0].forward, step[1], _getter(step[2]), step[3], step[4]) for step in plan)
        self._num_slots = len(slot)
        self._pad = (None,) * (len(slot) - len(user_names))
        # One supertask reading every user input in order: one call into the graph code.
        self._single = len(plan) == 1 and plan[0][2] == tuple(range(len(user_names))) and len(plan[0][3]) == 1
        self._forward, self._bound = self._plan[0][0], self._plan[0][1]
        self.program, self.fallback_reason = None, None
        if native and graph_program.enabled():
            try:
                self.program = graph_program.compile_plan([tuple(step[:4]) for step in plan], len(user_names),
                                                          self._out_slot)
            except graph_program.UnsupportedGraph as exc:
                self.fallback_reason = str(exc)
        else:
            self.fallback_reason = "disabled" if native else f"not enabled on {device.type}"

    @property
    def executor(self) -> str:
        """``'native'`` (one C++ program, ``backends/graph_program.py``) or ``'python'`` (the graphs' code)."""
        return "native" if self.program is not None else "python"

    def __call__(self, *user_inputs: torch.Tensor) -> torch.Tensor:
        if self.program is not None:
            return self.program.run(user_inputs)[0]
        if self._single:
            out = self._forward(*self._bound, *user_inputs)
            return out[0] if isinstance(out, (tuple, list)) else out
        slots = [*user_inputs, *self._pad]
        for forward, bound, take, outs, dead in self._plan:
            res = forward(*bound, *take(slots))
            for i, v in zip(outs, res):
                slots[i] = v
            for i in dead:
                slots[i] = None
        return slots[self._out_slot]


def _getter(indices: tuple[int, ...]):
    """``slots -> tuple of slots[i] for i in indices`` (C-level itemgetter where possible)."""
    if len(indices) >= 2:
        return operator.itemgetter(*indices)
    if len(indices) == 1:
        i = indices[0]
        return lambda slots: (slots[i],)
    return lambda slots: ()


def _topological(comps) -> list:
    """Compute supertasks in an order where each runs after the producers of its inputs."""
    produced_by = {name: key for key, t in comps for name in t.outputs}
    order, done, visiting = [], set(), set()
    tasks = dict(comps)

    def visit(key):
        if key in done:
            return
        if key in visiting:
            raise ValueError(f"supertask {key} is part of a cycle")
        visiting.add(key)
        for name in tasks[key].inputs:
            if name in produced_by:
                visit(produced_by[name])
        visiting.discard(key)
        done.add(key)
        order.append(tasks[key])

    for key, _ in comps:
        visit(key)
    return order


@register_backend("fx", "cpu")
def compile_fx_cpu(pipeline: Pipeline, params: dict[str, torch.Tensor], device: torch.device) -> FxExecutable:
    from .cpu import attention

    attention.install()  # C++ decode kernel for fxc::paged_attention (falls back to ATen with a warning)
    return FxExecutable(pipeline, params, device, native=True)


@register_backend("fx", "cuda")
def compile_fx_cuda(pipeline: Pipeline, params: dict[str, torch.Tensor], device: torch.device) -> FxExecutable:
    return FxExecutable(pipeline, params, device)
