"""A model's dataflow graph at layer granularity, its cuts, and the two halves of a split.

Capture
    :func:`capture` traces a model with :mod:`torch.fx`. Leaf modules are configurable (types
    or qualified names); KAPAO's decoder (:class:`~robot_offload.models.kapao.Detect`, whose
    grid cache needs concrete shapes) is a leaf by default. A model that fx cannot trace
    (torchvision's detectors: their forward iterates over the batch and branches on image
    sizes) is captured as a single opaque node instead, so it still has the two trivial cuts
    -- everything on the server (``input``) and everything on the robot (``output``) -- and
    :attr:`ModelGraph.traced` says that inner cuts are unavailable.

Nodes
    Every fx node is one of: ``input`` (a placeholder), ``data`` (depends on the input's
    values), ``shape`` (reads only a shape, rank, dtype or device -- ``x.shape``, ``x.size()``,
    ``x.dim()``), ``const`` (depends on neither: parameters, buffers, Python arithmetic on
    shapes) or ``output``. Only ``data`` tensors ever cross the network. A ``shape`` value is a
    function of the input *shape* alone, so the server obtains it from its own run of the
    model at that input shape (see :meth:`ModelGraph.record`) instead of receiving it; a
    ``const`` node is recomputed on whichever side needs it.

Cuts
    A cut is the set of live ``data`` tensors crossing from the robot part to the server part
    (DynO's "dependencies"): residual and concatenation branches that span the cut cross
    too. :meth:`ModelGraph.cut` accepts any such set and checks that it separates the input
    from the output; :meth:`ModelGraph.enumerate_cuts` yields the prefix cuts of the
    execution order (Neurosurgeon / DynO split points: "run every node up to here on the
    robot"), skipping those where a non-tensor (a tuple, a list) would have to cross.
"""

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch import nn

from robot_offload.errors import ConfigError
from robot_offload.tracing import ThisThreadTracer

#: Attribute reads that depend on a tensor's metadata only.
SHAPE_ATTRS = ("shape", "ndim", "dtype", "device", "is_cuda")
#: Methods that depend on a tensor's metadata only.
SHAPE_METHODS = ("size", "dim", "ndimension", "numel", "get_device")

INPUT_CUT = "input"
OUTPUT_CUT = "output"
#: how the output cut (the whole model on the robot) describes itself in plans and stats
OUTPUT_CUT_LABEL = "output (all on robot)"


class CutError(ConfigError):
    """A set of tensors that is not a valid cut of the graph (unknown, non-separating, ...)."""


@dataclass(frozen=True)
class TensorMeta:
    """What a node produced in a recorded run: a tensor's shape and dtype, or for non-tensor
    ``shape`` nodes their value (ints, torch.Size, dtype, device)."""

    is_tensor: bool
    shape: Tuple[int, ...] = ()
    dtype: Optional[torch.dtype] = None
    value: Any = None

    @property
    def nbytes(self) -> int:
        if not self.is_tensor:
            return 0
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Cut:
    """One split: ``crossing`` tensors (fx node names, in execution order) go up; the robot
    runs ``head`` (data nodes), the server ``tail`` (data nodes) and obtains ``statics``
    (``shape`` nodes) from its own record of the input shape."""

    crossing: Tuple[str, ...]
    head: FrozenSet[str]
    tail: FrozenSet[str]
    statics: Tuple[str, ...]
    kind: str                     # "input", "inner" or "output"
    last: str = ""                # the last head node in execution order ("" for input)

    @property
    def id(self) -> str:
        """Stable identifier: "input", "output" or the crossing names joined by commas."""
        if self.kind in (INPUT_CUT, OUTPUT_CUT):
            return self.kind
        return ",".join(self.crossing)

    @property
    def label(self) -> str:
        """Short human description for stats and logs."""
        if self.kind == INPUT_CUT:
            return "input (all on server)"
        if self.kind == OUTPUT_CUT:
            return OUTPUT_CUT_LABEL
        return f"after {self.last} ({len(self.crossing)} tensor{'s' if len(self.crossing) > 1 else ''})"


class _Tracer(ThisThreadTracer):
    def __init__(self, leaf_types: Tuple[type, ...], leaf_names: FrozenSet[str]):
        super().__init__()
        self.leaf_types = leaf_types
        self.leaf_names = leaf_names

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        if qualified_name in self.leaf_names or (self.leaf_types and isinstance(m, self.leaf_types)):
            return True
        return super().is_leaf_module(m, qualified_name)


class _Opaque(nn.Module):
    """Wraps an untraceable model so that it becomes one leaf node of a trivial graph."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)


def default_leaf_modules(model: nn.Module) -> Tuple[type, ...]:
    """Leaf module types a registry model needs (shape-dependent control flow inside)."""
    from robot_offload.models.kapao import Detect
    return (Detect,)


def capture(model: nn.Module, leaf_modules: Sequence = None, fallback: bool = True) -> "ModelGraph":
    """Trace ``model`` into a :class:`ModelGraph`.

    ``leaf_modules``: module types and/or qualified names kept as single nodes (default:
    :func:`default_leaf_modules`). If fx cannot trace the model and ``fallback`` is true, the
    whole model becomes one opaque node (only the input and output cuts); otherwise the
    trace error is raised as :class:`CutError`."""
    leaves = default_leaf_modules(model) if leaf_modules is None else tuple(leaf_modules)
    types = tuple(t for t in leaves if isinstance(t, type))
    names = frozenset(n for n in leaves if isinstance(n, str))
    try:
        graph = _Tracer(types, names).trace(model)
        gm = torch.fx.GraphModule(model, graph, type(model).__name__)
        return ModelGraph(gm, traced=True)
    except Exception as e:  # noqa: BLE001 - fx raises many kinds for untraceable code
        if not fallback:
            raise CutError(f"torch.fx cannot trace {type(model).__name__}: {e}") from e
        wrapper = _Opaque(model)
        graph = _Tracer((), frozenset({"model"})).trace(wrapper)
        gm = torch.fx.GraphModule(wrapper, graph, type(model).__name__)
        return ModelGraph(gm, traced=False, trace_error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


class ModelGraph:
    """An fx graph with node kinds, cut construction and head / tail modules (the latter
    cached, least recently used first out, :attr:`max_cached_modules` of them)."""

    max_cached_modules = 64

    def __init__(self, gm: torch.fx.GraphModule, traced: bool = True, trace_error: str = ""):
        self.gm = gm
        self.traced = traced
        self.trace_error = trace_error
        self.nodes: List[torch.fx.Node] = list(gm.graph.nodes)
        self.by_name: Dict[str, torch.fx.Node] = {n.name: n for n in self.nodes}
        self.index: Dict[str, int] = {n.name: i for i, n in enumerate(self.nodes)}
        self.inputs: Tuple[str, ...] = tuple(n.name for n in self.nodes if n.op == "placeholder")
        if len(self.inputs) != 1:
            raise CutError(f"graphs with {len(self.inputs)} inputs are not supported (need 1)")
        self.output_node = next(n for n in self.nodes if n.op == "output")
        self.kinds: Dict[str, str] = {}
        for n in self.nodes:
            self.kinds[n.name] = self._kind(n)
        #: data nodes in execution order, without the input
        self.order: Tuple[str, ...] = tuple(n.name for n in self.nodes
                                            if self.kinds[n.name] == "data" and n.op != "placeholder")
        self._lock = threading.Lock()
        self._modules: "OrderedDict[Tuple[str, Tuple[str, ...]], torch.fx.GraphModule]" = OrderedDict()

    # -- node kinds -----------------------------------------------------------------------
    def _kind(self, n: torch.fx.Node) -> str:
        if n.op == "placeholder":
            return "input"
        if n.op == "output":
            return "output"
        if n.op == "get_attr":
            return "const"
        if n.op == "call_function" and n.target is getattr and len(n.args) == 2 \
                and n.args[1] in SHAPE_ATTRS:
            return "shape"
        if n.op == "call_method" and n.target in SHAPE_METHODS:
            return "shape"
        if any(self.kinds[a.name] in ("input", "data") for a in n.all_input_nodes):
            return "data"
        return "const"

    def is_data(self, name: str) -> bool:
        return self.kinds.get(name) in ("input", "data")

    # -- recording ------------------------------------------------------------------------
    def record(self, x: torch.Tensor) -> Tuple[Dict[str, TensorMeta], Any]:
        """Run the graph on ``x``; returns every node's :class:`TensorMeta` and the output."""
        metas: Dict[str, TensorMeta] = {}
        graph = self

        class _Rec(torch.fx.Interpreter):
            def run_node(self, n):
                v = super().run_node(n)
                metas[n.name] = graph._meta(n, v)
                return v

        with torch.inference_mode():
            out = _Rec(self.gm).run(x)
        return metas, out

    def _meta(self, n: torch.fx.Node, v: Any) -> TensorMeta:
        if isinstance(v, torch.Tensor):
            return TensorMeta(True, tuple(int(s) for s in v.shape), v.dtype)
        if self.kinds.get(n.name) == "shape":
            return TensorMeta(False, value=v)
        return TensorMeta(False)

    # -- cuts -----------------------------------------------------------------------------
    def _head_closure(self, crossing: Iterable[str]) -> FrozenSet[str]:
        """Data nodes the robot must run to produce ``crossing`` (input excluded)."""
        seen, stack = set(), list(crossing)
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            stack.extend(a.name for a in self.by_name[name].all_input_nodes)
        return frozenset(s for s in seen if self.kinds[s] == "data")

    def cut(self, crossing: Sequence[str]) -> Cut:
        """The cut whose crossing tensors are ``crossing`` (node names, any order).

        Raises :class:`CutError` when a name is unknown or not a data node, repeated, not
        needed by the rest of the graph, or when the set does not separate the input from
        the output (the server part would need the input or another robot-side tensor)."""
        crossing = list(crossing)
        if not crossing:
            raise CutError("a cut needs at least one crossing tensor")
        if len(set(crossing)) != len(crossing):
            raise CutError("a cut names a tensor twice")
        for name in crossing:
            if not isinstance(name, str) or name not in self.by_name:
                raise CutError(f"unknown node {str(name)[:80]!r}")
            if not self.is_data(name):
                raise CutError(f"node {name!r} is a {self.kinds[name]} node; only data tensors cross")
        cross = set(crossing)
        ordered = tuple(sorted(cross, key=self.index.__getitem__))
        # Walk back from the output; stop at crossing tensors and shape reads.
        tail, statics, reached, stack = set(), set(), set(), [self.output_node]
        seen = set()
        while stack:
            n = stack.pop()
            if n.name in seen:
                continue
            seen.add(n.name)
            for a in n.all_input_nodes:
                k = self.kinds[a.name]
                if a.name in cross:
                    reached.add(a.name)
                elif k == "input":
                    raise CutError(f"the cut {list(ordered)[:4]}... does not separate the input "
                                   f"from the output (node {n.name!r} needs the input)")
                elif k == "shape":
                    statics.add(a.name)
                else:
                    if k == "data":
                        tail.add(a.name)
                    stack.append(a)
        unused = cross - reached
        if unused:
            raise CutError(f"crossing tensors not needed by the server part: {sorted(unused)[:4]}")
        head = self._head_closure(ordered)
        overlap = head & tail
        if overlap:
            raise CutError(f"the cut does not separate the graph: {sorted(overlap)[:4]} would run "
                           f"on both sides")
        if ordered == self.inputs:
            kind = INPUT_CUT
        elif not tail:
            kind = OUTPUT_CUT
        else:
            kind = "inner"
        last = max(head, key=self.index.__getitem__) if head else ""
        return Cut(crossing=ordered, head=head, tail=frozenset(tail),
                   statics=tuple(sorted(statics, key=self.index.__getitem__)), kind=kind, last=last)

    def input_cut(self) -> Cut:
        return self.cut(self.inputs)

    def output_cut(self) -> Cut:
        """Everything on the robot: the data nodes the output reads directly cross (they are
        not sent anywhere)."""
        return self.cut(self._prefix_crossing(len(self.order)))

    def _prefix_crossing(self, k: int) -> List[str]:
        head = set(self.inputs) | set(self.order[:k])
        tail = set(self.order[k:])
        out = []
        for n in self.nodes:
            if n.name in head and any(u.name in tail or u.op == "output" for u in n.users):
                out.append(n.name)
        return out

    def enumerate_cuts(self, metas: Optional[Dict[str, TensorMeta]] = None) -> List[Cut]:
        """Prefix cuts in execution order, input cut first and output cut last, without
        duplicates. With ``metas`` (from :meth:`record`) cuts where a non-tensor value would
        cross are left out; the input and output cuts are always included."""
        cuts, seen = [], set()
        if not self.traced:
            return [self.input_cut(), self.output_cut()]
        head = set(self.inputs)
        tail_users = {n.name: {u.name for u in n.users} for n in self.nodes}
        live: Dict[str, None] = {name: None for name in self.inputs}
        for k in range(len(self.order) + 1):
            if k > 0:
                name = self.order[k - 1]
                head.add(name)
                live[name] = None
            crossing = []
            for name in list(live):
                users = tail_users[name]
                if any((u not in head and self.kinds[u] == "data") or u == self.output_node.name
                       for u in users):
                    crossing.append(name)
                else:
                    del live[name]           # never needed again
            key = tuple(crossing)
            if key in seen:
                continue
            if 0 < k < len(self.order) and metas is not None and \
                    not all(c in metas and metas[c].is_tensor for c in crossing):
                continue
            try:
                c = self.cut(crossing)
            except CutError:
                continue
            seen.add(key)
            cuts.append(c)
        if cuts[-1].kind != OUTPUT_CUT:   # e.g. the last node's crossing equals an earlier cut's
            cuts.append(self.output_cut())
        return cuts

    # -- the two halves -------------------------------------------------------------------
    def head_module(self, cut: Cut) -> torch.fx.GraphModule:
        """``x -> tuple(crossing tensors)``, sharing parameters with the model."""
        key = ("head", cut.crossing)
        cached = self._cached(key)
        if cached is not None:
            return cached
        needed, stack = set(), list(cut.crossing)
        while stack:
            name = stack.pop()
            if name not in needed:
                needed.add(name)
                stack.extend(a.name for a in self.by_name[name].all_input_nodes)
        g = torch.fx.Graph()
        env: Dict[str, torch.fx.Node] = {}
        for n in self.nodes:
            if n.name in needed or n.op == "placeholder":
                env[n.name] = g.node_copy(n, lambda a: env[a.name])
        g.output(tuple(env[c] for c in cut.crossing))
        return self._finish(key, g)

    def tail_module(self, cut: Cut) -> torch.fx.GraphModule:
        """``(*crossing tensors, *static values) -> model output``, sharing parameters."""
        key = ("tail", cut.crossing)
        cached = self._cached(key)
        if cached is not None:
            return cached
        g, env = self._part_graph(cut.crossing + cut.statics, cut.tail,
                                  list(cut.tail) + [self.output_node.name])
        out_arg = torch.fx.node.map_arg(self.output_node.args[0], lambda a: env[a.name])
        g.output(out_arg)
        return self._finish(key, g)

    def _part_graph(self, inputs, nodes, roots):
        """A new graph with placeholders ``inputs`` and copies of ``nodes`` plus the const
        nodes that ``roots`` (node names) read, in execution order; returns it and the
        name -> copied node map."""
        g = torch.fx.Graph()
        env: Dict[str, torch.fx.Node] = {}
        for name in inputs:
            env[name] = g.placeholder(name)
        keep = set(nodes)
        stack = [a for n in roots for a in self.by_name[n].all_input_nodes]
        while stack:
            a = stack.pop()
            if a.name in keep or a.name in env or self.kinds[a.name] != "const":
                continue
            keep.add(a.name)
            stack.extend(a.all_input_nodes)
        for n in self.nodes:
            if n.name in keep:
                env[n.name] = g.node_copy(n, lambda a: env[a.name])
        return g, env

    def middle_module(self, first: Cut, last: Cut) -> torch.fx.GraphModule:
        """``(*first's crossing tensors, *first's static values) -> tuple(last's crossing
        tensors)``: the part of the graph between two cuts (``first`` earlier), sharing
        parameters. What a server runs when it hands the rest of the model back to the
        robot (lop's robot tail)."""
        if not first.head <= last.head or last.kind == OUTPUT_CUT:
            raise CutError("a middle part runs from a cut to a later cut before the outputs")
        key = ("middle", first.crossing, last.crossing)
        cached = self._cached(key)
        if cached is not None:
            return cached
        middle = last.head - first.head
        g, env = self._part_graph(first.crossing + first.statics, middle, middle)
        g.output(tuple(env[c] for c in last.crossing))
        return self._finish(key, g)

    def _cached(self, key):
        with self._lock:
            gm = self._modules.get(key)
            if gm is not None:
                self._modules.move_to_end(key)
            return gm

    def _finish(self, key, g: torch.fx.Graph) -> torch.fx.GraphModule:
        g.lint()
        gm = torch.fx.GraphModule(self.gm, g, f"{type(self.gm).__name__}_{key[0]}")
        with self._lock:
            gm = self._modules.setdefault(key, gm)
            self._modules.move_to_end(key)
            while len(self._modules) > self.max_cached_modules:
                self._modules.popitem(last=False)
            return gm

    def static_values(self, cut: Cut, metas: Dict[str, TensorMeta]) -> List[Any]:
        """The values of ``cut.statics`` from a record at the same input shape."""
        try:
            return [metas[s].value for s in cut.statics]
        except KeyError as e:
            raise CutError(f"no recorded value for shape node {e}") from None

    def run_split(self, cut: Cut, x: torch.Tensor, metas: Dict[str, TensorMeta], transform=None):
        """Head then tail in this process (``transform`` maps each crossing tensor, e.g. an
        encode/decode round trip): what a split computes, without a server."""
        with torch.inference_mode():
            if cut.kind == OUTPUT_CUT:
                return self.gm(x)
            tensors = self.head_module(cut)(x)
            if transform is not None:
                tensors = [transform(name, t) for name, t in zip(cut.crossing, tensors)]
            return self.tail_module(cut)(*tensors, *self.static_values(cut, metas))
