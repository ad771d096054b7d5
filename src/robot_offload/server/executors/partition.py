"""Server side of layer partitioning: the ``partition_tail`` compute entry.

Request: ``ComputeRequest(entry="partition_tail", args_json=..., tensors=[...])`` with

* ``args_json`` = ``{"cut": <cut id | [node names]>, "input_shape": [N, C, H, W]}`` and no
  other key. The cut is the set of crossing tensors (fx node names of the model's graph;
  a cut id is the same names joined by commas, or ``"input"``), ``input_shape`` the shape
  of the robot's model input (it fixes every tensor shape and every shape value of the
  graph);
* ``tensors``: exactly the crossing tensors, each named by its node, with the shape and
  dtype the model produces there for that input shape.

The server captures the fx graph of *its own* registry model (the one it built and whose
weights hash the client agreed to), caches the tail module of each cut, runs the tail on
the decoded tensors and answers with the outputs (``OffloadServer.encode_outputs``). Shape
values the tail needs (``x.shape`` read at the input, say) come from the server's own run
of the model on zeros of ``input_shape`` (cached per shape), never from the request.
Everything in the request is checked first; a bad one is answered with BAD_REQUEST.
Nothing received is evaluated or unpickled: names are looked up in the graph, tensors go
through the codec.
"""

import json
import threading
import time
from collections import OrderedDict
from typing import Dict, List, Tuple

import torch

from robot_offload import codec
from robot_offload.partition.graph import INPUT_CUT, OUTPUT_CUT, Cut, CutError, ModelGraph, capture
from robot_offload.protocol import ComputeRequest, ComputeResponse, StatusCode
from robot_offload.server.base import Executor, LoadedModel, RequestRejected

ENTRY = "partition_tail"
ARG_KEYS = frozenset({"cut", "input_shape"})
MAX_CUT_NAMES = 1024
MAX_NAME_CHARS = 256
MAX_DIMS = 8
MAX_SHAPES = 4      # shape records kept per model (each costs one forward to make)
MAX_CUTS = 64       # parsed cuts kept per model


class _ModelState:
    """Per loaded model: its graph, parsed cuts and shape records (LRU), one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.graph = None
        self.error = ""
        self.cuts: "OrderedDict[Tuple[str, ...], Cut]" = OrderedDict()
        self.records: "OrderedDict[Tuple[int, ...], Dict]" = OrderedDict()
        self.spatial: "OrderedDict[Tuple[int, ...], object]" = OrderedDict()   # the lop entry's


def _bad(text: str) -> RequestRejected:
    return RequestRejected(StatusCode.BAD_REQUEST, text)


def _state(loaded: LoadedModel) -> _ModelState:
    """The partition entries' state of ``loaded``, kept on the loaded model itself."""
    with loaded.lock:
        if loaded.derived is None:
            loaded.derived = _ModelState()
        return loaded.derived


def model_graph(loaded: LoadedModel) -> ModelGraph:
    """The server's graph of ``loaded`` (captured once)."""
    st = _state(loaded)
    with st.lock:
        if st.graph is None:
            st.graph = capture(loaded.module)
        return st.graph


def json_object(args_json: str) -> dict:
    """``args_json`` as a JSON object, or BAD_REQUEST (shared by the entries that take arguments)."""
    if not isinstance(args_json, str) or len(args_json) > 1 << 20:
        raise _bad("args_json must be a JSON string under 1 MiB")
    try:
        args = json.loads(args_json)
    except ValueError as e:
        raise _bad(f"args_json is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise _bad("args_json must be a JSON object")
    return args


def node_names(value, key: str) -> List[str]:
    """A list of node names (or a cut id: names joined by commas), checked for size."""
    if isinstance(value, str):
        value = value.split(",") if value else []
    if not isinstance(value, list) or not value or len(value) > MAX_CUT_NAMES:
        raise _bad(f"'{key}' must be a cut id or a list of 1..{MAX_CUT_NAMES} node names")
    if not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME_CHARS for n in value):
        raise _bad(f"'{key}' names must be non-empty strings of at most {MAX_NAME_CHARS} characters")
    return value


def input_shape(value, max_elements: int) -> Tuple[int, ...]:
    """A model input shape: 1..MAX_DIMS positive ints, at most ``max_elements`` in all."""
    if not (isinstance(value, list) and 1 <= len(value) <= MAX_DIMS
            and all(type(s) is int and 0 < s <= 1 << 30 for s in value)):
        raise _bad(f"'input_shape' must be a list of 1..{MAX_DIMS} positive ints")
    numel = 1
    for s in value:
        numel *= s
    if numel > max_elements:
        raise RequestRejected(StatusCode.TOO_LARGE, f"input_shape {value} has {numel} elements; "
                              f"max_input_elements is {max_elements}")
    return tuple(value)


def parse_args(args_json: str, max_elements: int) -> Tuple[List[str], Tuple[int, ...]]:
    """Validate ``args_json``; returns (crossing names, input shape)."""
    args = json_object(args_json)
    unknown = set(args) - ARG_KEYS
    if unknown:
        raise _bad(f"unknown argument(s) {sorted(unknown)[:4]}; known: {sorted(ARG_KEYS)}")
    if "cut" not in args or "input_shape" not in args:
        raise _bad("partition_tail needs 'cut' and 'input_shape'")
    return node_names(args["cut"], "cut"), input_shape(args["input_shape"], max_elements)


def _cut(st: _ModelState, graph: ModelGraph, names: List[str], allow_output: bool = False) -> Cut:
    """The cut named by ``names`` (parsed cuts cached per model), or BAD_REQUEST; the
    output cut only with ``allow_output`` (lop's regions may end there)."""
    key = tuple(names)
    with st.lock:
        cut = st.cuts.get(key)
        if cut is not None and (allow_output or cut.kind != OUTPUT_CUT):
            st.cuts.move_to_end(key)
            return cut
    if names == [INPUT_CUT]:
        names = list(graph.inputs)
    try:
        cut = graph.cut(names)
    except CutError as e:
        raise _bad(f"unknown or invalid cut: {e}") from None
    with st.lock:
        st.cuts[key] = cut
        while len(st.cuts) > MAX_CUTS:
            st.cuts.popitem(last=False)
    if cut.kind == OUTPUT_CUT and not allow_output:
        raise _bad("the output cut leaves nothing for the server to compute")
    return cut


def _record(st: _ModelState, graph: ModelGraph, loaded: LoadedModel, shape: Tuple[int, ...],
            server) -> Dict:
    with st.lock:
        rec = st.records.get(shape)
        if rec is not None:
            st.records.move_to_end(shape)
            return rec
        try:
            rec, _ = graph.record(torch.zeros(shape, dtype=torch.float32, device=server.device))
        except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as e:
            raise _bad(f"{loaded.name} rejects input_shape {list(shape)}: "
                       f"{str(e).splitlines()[0][:300]}") from e
        st.records[shape] = rec
        while len(st.records) > MAX_SHAPES:
            st.records.popitem(last=False)
        return rec


def check_tensors(req: ComputeRequest, cut: Cut, rec: Dict) -> List[int]:
    """Names, shapes and dtypes of the request's tensors against the cut and the shape
    record; returns, per crossing tensor, its index in ``req.tensors``."""
    index = {}
    for i, enc in enumerate(req.tensors):
        if enc.name in index:
            raise _bad(f"tensor {enc.name[:80]!r} sent twice")
        index[enc.name] = i
    missing = [n for n in cut.crossing if n not in index]
    extra = [n for n in index if n not in cut.crossing]
    if missing or extra:
        raise _bad(f"the cut needs tensors {list(cut.crossing)[:8]}; missing {missing[:4]}, "
                   f"unexpected {[e[:80] for e in extra[:4]]}")
    for name in cut.crossing:
        enc, meta = req.tensors[index[name]], rec[name]
        if not meta.is_tensor:
            raise _bad(f"node {name!r} is not a tensor")
        if list(enc.shape) != list(meta.shape):
            raise _bad(f"tensor {name!r} has shape {list(enc.shape)[:8]}; the model makes "
                       f"{list(meta.shape)} there")
        if enc.dtype != codec.dtype_name(meta.dtype):
            raise _bad(f"tensor {name!r} has dtype {enc.dtype[:20]}; the model makes "
                       f"{codec.dtype_name(meta.dtype)} there")
    return [index[n] for n in cut.crossing]


def run_tail(server, loaded: LoadedModel, graph: ModelGraph, cut: Cut,
             tensors: List[torch.Tensor], rec: Dict, runner=None, until: Cut = None):
    """Run the tail of ``cut`` on the crossing ``tensors`` (shape values from ``rec``);
    returns (outputs, compute seconds). With ``until`` only the part up to that later cut
    runs and the outputs are its crossing tensors (a tuple). ``runner(fn)`` runs ``fn``
    elsewhere (lop's compute thread); a failure of the model on these tensors is a
    BAD_REQUEST."""
    statics = graph.static_values(cut, rec)
    module = graph.tail_module(cut) if until is None else graph.middle_module(cut, until)

    def tail():
        with torch.inference_mode():
            y = module(*tensors, *statics)
        server.synchronize()
        return y

    t0 = time.perf_counter()
    try:
        y = runner(tail) if runner is not None else tail()
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as e:
        raise _bad(f"{loaded.name} tail of cut {cut.label} failed: {str(e).splitlines()[0][:300]}") from e
    return y, time.perf_counter() - t0


class PartitionTailExecutor(Executor):
    ENTRY = ENTRY
    QUEUED = True

    def __call__(self, loaded: LoadedModel, req: ComputeRequest) -> ComputeResponse:
        return partition_tail(self.server, loaded, req)


def partition_tail(server, loaded: LoadedModel, req: ComputeRequest) -> ComputeResponse:
    """Run the server part of a layer partition (see the module docstring)."""
    names, shape = parse_args(req.args_json, server.config.max_input_elements)
    st = _state(loaded)
    graph = model_graph(loaded)
    if not graph.traced and names != [INPUT_CUT] and tuple(names) != graph.inputs:
        raise _bad(f"{loaded.name} has no inner cuts (torch.fx cannot trace it: {graph.trace_error})")
    cut = _cut(st, graph, names)
    rec = _record(st, graph, loaded, shape, server)
    order = check_tensors(req, cut, rec)
    decoded = server.decode_inputs(req)
    tensors = [decoded[i] for i in order]
    y, compute_s = run_tail(server, loaded, graph, cut, tensors, rec)
    out, spec = server.encode_outputs(y, req)
    return ComputeResponse(status=StatusCode.OK, tensors=out, structure_json=spec,
                           result_json=json.dumps({"cut": cut.label, "tail_nodes": len(cut.tail)}),
                           server_compute_s=compute_s)
