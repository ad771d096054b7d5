"""Server side of local-operator parallelism: the ``lop_part`` compute entry.

``{"phase": "prepare", "input_shape": [N, C, H, W]}``
    Capture the graph, record it at that input shape and analyse its operators now, so
    that the first inference does not pay for it (a forward pass of the whole model). The
    client sends it once per input shape and server.

One lop inference is two requests with the same client-chosen ``frame`` id:

``{"phase": "part", "frame": F, "first": [c1 names], "last": [c2 names], "split": {name: row},
"input_shape": [N, C, H, W]}``
    Transfer A. ``first`` and ``last`` are two prefix cuts of the model's graph with only
    local operators between them (:class:`~robot_offload.partition.spatial.Region`);
    ``split`` gives, for every tensor crossing ``last``, the first row of the server's
    stripe (the robot computes the rows above). The tensors are, for every ``first`` tensor
    the stripe needs, exactly the rows it needs (the server derives them from the split
    with the same receptive-field walk as the robot). The server computes its stripe, keeps
    it for the frame and answers (no tensors).

    With ``"join": "robot"`` (optional; implied when ``last`` is the output cut) the
    answer instead carries the server's rows of every ``last`` tensor (from its split row
    to the bottom, encoded with the request's output codec; ``result_json["rows"]`` names
    each one's first row) and the frame ends there: the robot joins them under its own
    rows and runs the rest of the model itself. One request per inference, and only the
    server's share of those tensors comes down (AGRNav's 10.5 MB of occupancy and labels;
    KAPAO's head maps instead of its 2 MB of decoded predictions).

``{"phase": "finish", "frame": F, "last": [c2 names], "input_shape": [...]}``
    Transfer B: for every ``last`` tensor, the rows above those the server holds. The
    server waits (at most ``wait_s``) for the frame's stripe, joins the rows and runs the
    tail of the model after ``last`` (as ``partition_tail`` does) and answers with the
    outputs. With ``"until": [c3 names]`` (optional; a cut after ``last``, before the
    outputs) it runs only up to ``until`` and answers with those tensors, whole, named, in
    the request's output codec: the robot runs the rest (a detection decoder that takes
    milliseconds and turns 24 KB of head maps into 2 MB of predictions).

Frames are kept per client id, :data:`FRAME_TTL_S` seconds each, at most
:data:`MAX_FRAMES_PER_CLIENT` of one client (a new part drops that client's oldest frame;
its finish is refused, naming why) and :data:`MAX_FRAMES` in all (then a part is answered
``BUSY``), so that parts whose finish never comes (refused ones, or those of a frame the
robot's hedge answered) cannot keep other clients out; a ``finish`` without its ``part``
is refused once the wait expires. As for
every entry, the server runs only its own registry model, the request is checked before
anything runs (names against the graph, shapes and dtypes against the stripe, integers
in range), and nothing received is evaluated.
"""

import concurrent.futures
import json
import threading
import time
from typing import Dict, List, Tuple

import torch

from robot_offload import codec
from robot_offload.server.executors.partition import (_bad, _cut, _record, _state, input_shape,
                                                     json_object, model_graph, node_names, run_tail)
from robot_offload.partition.graph import INPUT_CUT, OUTPUT_CUT, Cut, CutError
from robot_offload.partition.spatial import Region, SpatialGraph
from robot_offload.protocol import ID_RE, ComputeRequest, ComputeResponse, StatusCode
from robot_offload.server.base import Executor, LoadedModel, RequestRejected

ENTRY = "lop_part"
PREPARE_KEYS = frozenset({"phase", "input_shape"})
PART_KEYS = frozenset({"phase", "frame", "first", "last", "split", "input_shape"})
PART_OPTIONAL = frozenset({"join"})
JOINS = ("server", "robot")
FINISH_KEYS = frozenset({"phase", "frame", "last", "input_shape"})
FINISH_OPTIONAL = frozenset({"until"})
MAX_FRAMES = 32
#: frames one client may hold waiting for their finish (a robot has one in flight, and a
#: few left by hedges or failures)
MAX_FRAMES_PER_CLIENT = 4
FRAME_TTL_S = 30.0
MAX_SPATIAL = 4         # spatial graphs kept per model (one per input shape)


class _Frame:
    def __init__(self):
        self.done = threading.Event()
        self.created = time.monotonic()
        self.held: Dict[str, Tuple[torch.Tensor, int]] = {}
        self.last: Tuple[str, ...] = ()
        self.shape: Tuple[int, ...] = ()
        self.error = ""


def parse_args(args_json: str, max_elements: int) -> dict:
    args = json_object(args_json)
    phase = args.get("phase")
    keys = {"prepare": PREPARE_KEYS, "part": PART_KEYS, "finish": FINISH_KEYS}.get(phase)
    if keys is None:
        raise _bad("'phase' must be 'prepare', 'part' or 'finish'")
    optional = {"part": PART_OPTIONAL, "finish": FINISH_OPTIONAL}.get(phase, frozenset())
    if not keys <= set(args) <= keys | optional:
        raise _bad(f"lop_part {phase} takes exactly {sorted(keys)}"
                   + (f", and optionally {sorted(optional)}" if optional else ""))
    if phase != "prepare" and (not isinstance(args["frame"], str) or not ID_RE.fullmatch(args["frame"])):
        raise _bad("'frame' must be 8..64 lowercase hex digits")
    args["input_shape"] = input_shape(args["input_shape"], max_elements)
    if phase == "prepare":
        return args
    args["last"] = node_names(args["last"], "last")
    if "until" in args:
        args["until"] = node_names(args["until"], "until")
    if phase == "part":
        args["first"] = node_names(args["first"], "first")
        if args.get("join", "server") not in JOINS:
            raise _bad(f"'join' must be one of {list(JOINS)}")
        split = args["split"]
        if not isinstance(split, dict) or not all(isinstance(k, str) and type(v) is int and v >= 0
                                                  for k, v in split.items()):
            raise _bad("'split' must map node names to non-negative row numbers")
    return args


def _spatial(st, graph, rec, shape) -> SpatialGraph:
    with st.lock:
        sg = st.spatial.get(shape)
        if sg is None:
            sg = st.spatial[shape] = SpatialGraph(graph, rec)
            while len(st.spatial) > MAX_SPATIAL:
                st.spatial.popitem(last=False)
        return sg


def _check(req: ComputeRequest, sg: SpatialGraph, rec, expected: Dict[str, Tuple[int, int]]) -> Dict[str, int]:
    """The request's tensors are exactly ``expected`` (name -> rows), each with the model's
    shape there except for the rows, and its dtype; returns name -> index."""
    index = {}
    for i, enc in enumerate(req.tensors):
        if enc.name in index:
            raise _bad(f"tensor {enc.name[:80]!r} sent twice")
        index[enc.name] = i
    missing = [n for n in expected if n not in index]
    extra = [n[:80] for n in index if n not in expected]
    if missing or extra:
        raise _bad(f"the stripe needs tensors {list(expected)[:8]}; missing {missing[:4]}, "
                   f"unexpected {extra[:4]}")
    for name, (a, b) in expected.items():
        enc, meta = req.tensors[index[name]], rec[name]
        shape = list(meta.shape)
        shape[sg.axis(name)] = b - a
        if list(enc.shape) != shape:
            raise _bad(f"tensor {name!r} has shape {list(enc.shape)[:8]}; rows [{a}, {b}) of the "
                       f"model's tensor there have shape {shape}")
        if enc.dtype != codec.dtype_name(meta.dtype):
            raise _bad(f"tensor {name!r} has dtype {enc.dtype[:20]}; the model makes "
                       f"{codec.dtype_name(meta.dtype)} there")
    return index


def _region(st, graph, sg: SpatialGraph, first: List[str], last: List[str]) -> Tuple[Region, Cut]:
    c1 = graph.input_cut() if first == [INPUT_CUT] else _cut_any(st, graph, first)
    c2 = _cut_any(st, graph, last)
    try:
        return sg.region(c1, c2), c2
    except CutError as e:
        raise _bad(f"not a local region: {e}") from None


def _cut_any(st, graph, names: List[str]) -> Cut:
    """A cut by names; unlike partition_tail's, the output cut is allowed (the tail is then
    only the output's structure)."""
    if tuple(names) == graph.inputs:
        return graph.input_cut()
    c = _cut(st, graph, names, allow_output=True)
    if c.kind == INPUT_CUT:
        raise _bad("the last cut of a region cannot be the input")
    return c


class LopExecutor(Executor):
    """The ``lop_part`` entry of one server: the frames whose part ran and whose finish
    is awaited, and the one thread all lop computation runs on."""

    ENTRY = ENTRY

    def __init__(self, server, wait_s: float = 10.0):
        super().__init__(server)
        self.frames: Dict[Tuple[str, str], _Frame] = {}
        self.frames_lock = threading.Lock()
        #: All lop computation runs on this one thread. rospy serves each service connection on a
        #: thread of its own and a frame's two requests arrive on two connections; every thread
        #: that calls into torch gets its own OpenMP team, whose idle workers spin for a while
        #: after each call, so the part's team took the CPU from the finish's tail (2x slower tails
        #: on a 2-core machine). One compute thread means one team, as for the other entries.
        self.compute = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lop-compute")
        #: How long a ``finish`` waits for its ``part`` (s).
        self.wait_s = wait_s

    def _expire(self, now: float) -> None:
        for key in [k for k, f in self.frames.items() if now - f.created > FRAME_TTL_S]:
            del self.frames[key]

    def _drop_oldest_of(self, client_id: str) -> None:
        """Make room for one more frame of ``client_id`` (under ``frames_lock``): its
        oldest frames go while it holds :data:`MAX_FRAMES_PER_CLIENT`; a finish waiting
        for one learns why at once."""
        mine = sorted((f.created, k) for k, f in self.frames.items() if k[0] == client_id)
        for _, key in mine[:max(0, len(mine) - MAX_FRAMES_PER_CLIENT + 1)]:
            frame = self.frames.pop(key)
            frame.error = frame.error or (f"dropped: {MAX_FRAMES_PER_CLIENT} newer lop frames of "
                                          "this client came before its finish")
            frame.done.set()

    def __call__(self, loaded: LoadedModel, req: ComputeRequest) -> ComputeResponse:
        """One of the two requests of a lop inference (see the module docstring)."""
        server = self.server
        args = parse_args(req.args_json, server.config.max_input_elements)
        st = _state(loaded)
        graph = model_graph(loaded)
        if not graph.traced:
            raise _bad(f"{loaded.name} has no local regions (torch.fx cannot trace it: {graph.trace_error})")
        rec = _record(st, graph, loaded, args["input_shape"], server)
        sg = _spatial(st, graph, rec, args["input_shape"])
        if args["phase"] == "prepare":
            return ComputeResponse(status=StatusCode.OK, tensors=[], structure_json="null",
                                   result_json=json.dumps({"local_nodes": sum(
                                       k != "global" for k in sg.kinds().values())}))
        if args["phase"] == "part":
            return self._part(loaded, req, args, st, graph, rec, sg)
        return self._finish(loaded, req, args, st, graph, rec, sg)

    def _part(self, loaded, req, args, st, graph, rec, sg) -> ComputeResponse:
        server = self.server
        key = (req.client_id, args["frame"])
        frame = _Frame()
        with self.frames_lock:
            self._expire(time.monotonic())
            if key in self.frames:
                raise _bad(f"frame {args['frame']} was sent twice")
            self._drop_oldest_of(req.client_id)
            if len(self.frames) >= MAX_FRAMES:
                raise RequestRejected(StatusCode.BUSY, f"{MAX_FRAMES} lop frames are waiting; try later")
            self.frames[key] = frame
        # From here on the frame is registered, so that its finish learns of any failure at
        # once instead of waiting for a part that will never come.
        t0 = time.perf_counter()
        try:
            region, c2 = _region(st, graph, sg, args["first"], args["last"])
            split = args["split"]
            if set(split) != set(region.outputs):
                raise _bad(f"'split' must give a row for each of {list(region.outputs)[:8]}")
            rows = {}
            for name in region.outputs:
                h = sg.rows(name)
                if split[name] > h:
                    raise _bad(f"split row {split[name]} of {name!r} is beyond its {h} rows")
                rows[name] = (split[name], h)
            need = sg.needs(region, rows)
            expected = {n: need[n] for n in region.inputs if n in need}
            index = _check(req, sg, rec, expected)
            decoded = server.decode_inputs(req)
            held = {n: (decoded[index[n]], expected[n][0]) for n in expected}
            frame.last, frame.shape = tuple(region.outputs), args["input_shape"]
            t0 = time.perf_counter()

            def stripe():
                result = sg.run(region, need, held)
                server.synchronize()
                return result

            out = self.compute.submit(stripe).result()
            for name in region.outputs:
                if name in out and out[name][0].shape[sg.axis(name)] + out[name][1] != sg.rows(name):
                    raise _bad(f"the server's stripe of {name!r} does not reach the last row")
            frame.held = out
            keep = c2.kind == OUTPUT_CUT or args.get("join") == "robot"
            if keep:
                # The robot joins the rows (always when the region ends at the model's
                # outputs): this answer carries ours, so no finish follows.
                with self.frames_lock:
                    self.frames.pop(key, None)
                tensors, rows_sent = [], {}
                for name in region.outputs:
                    if name in out and name not in region.inputs:
                        t, r0 = out[name]
                        first_row = split[name]
                        t = t.narrow(sg.axis(name), first_row - r0, sg.rows(name) - first_row)
                        tensors.append(codec.encode_or_raw(t.contiguous(), name, req.output_codec,
                                                           req.output_compression))
                        rows_sent[name] = first_row
        except RequestRejected as e:
            frame.error = str(e)
            raise
        except torch.cuda.OutOfMemoryError:
            frame.error = "out of memory"
            raise
        except (RuntimeError, ValueError, IndexError, TypeError, CutError) as e:
            frame.error = f"{loaded.name} stripe failed: {str(e).splitlines()[0][:300]}"
            raise _bad(frame.error) from e
        except BaseException as e:
            frame.error = f"internal error ({type(e).__name__})"
            raise
        finally:
            frame.done.set()
        compute_s = time.perf_counter() - t0
        result = {"frame": args["frame"], "stripe_nodes": len(need)}
        if keep:
            result["rows"] = rows_sent
            return ComputeResponse(status=StatusCode.OK, tensors=tensors, structure_json="null",
                                   result_json=json.dumps(result), server_compute_s=compute_s)
        return ComputeResponse(status=StatusCode.OK, tensors=[], structure_json="null",
                               result_json=json.dumps(result), server_compute_s=compute_s)


    def _finish(self, loaded, req, args, st, graph, rec, sg) -> ComputeResponse:
        server = self.server
        key = (req.client_id, args["frame"])
        deadline = time.monotonic() + self.wait_s
        frame = None
        while frame is None:
            with self.frames_lock:
                frame = self.frames.get(key)
            if frame is None:
                if time.monotonic() >= deadline:
                    raise _bad(f"no lop part for frame {args['frame']}")
                time.sleep(0.002)
        if not frame.done.wait(max(0.0, deadline - time.monotonic())):
            raise _bad(f"the part of frame {args['frame']} did not finish within {self.wait_s} s")
        with self.frames_lock:
            self.frames.pop(key, None)
        if frame.error:
            raise _bad(f"the part of frame {args['frame']} failed: {frame.error[:300]}")
        if tuple(args["last"]) != frame.last or args["input_shape"] != frame.shape:
            raise _bad("finish names another cut or input shape than its part")
        c2 = _cut_any(st, graph, args["last"])
        expected = {}
        for name in c2.crossing:
            held = frame.held.get(name)
            first = held[1] if held is not None else sg.rows(name)
            if first > 0:
                expected[name] = (0, first)
        index = _check(req, sg, rec, expected)
        decoded = server.decode_inputs(req)
        tensors = []
        for name in c2.crossing:
            parts = []
            if name in expected:
                parts.append(decoded[index[name]])
            if name in frame.held:
                parts.append(frame.held[name][0])
            tensors.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=sg.axis(name)))
        c3 = None
        if "until" in args:
            c3 = _cut_any(st, graph, args["until"])
            if c3.kind == OUTPUT_CUT or not c2.head < c3.head:
                raise _bad("'until' must be a cut after 'last' and before the outputs")
        y, compute_s = run_tail(server, loaded, graph, c2, tensors, rec,
                                runner=lambda fn: self.compute.submit(fn).result(), until=c3)
        result = {"cut": c2.label, "kind": OUTPUT_CUT if c2.kind == OUTPUT_CUT else "inner"}
        if c3 is not None:
            out = [codec.encode_or_raw(t, name, req.output_codec, req.output_compression)
                   for name, t in zip(c3.crossing, y)]
            result["until"] = c3.label
            return ComputeResponse(status=StatusCode.OK, tensors=out, structure_json="null",
                                   result_json=json.dumps(result), server_compute_s=compute_s)
        out, spec = server.encode_outputs(y, req)
        return ComputeResponse(status=StatusCode.OK, tensors=out, structure_json=spec,
                               result_json=json.dumps(result), server_compute_s=compute_s)
