"""Operator analysis and spatial execution for local-operator parallelism (Intra-DP §4.1).

Operator classes
    Every data node of a :class:`~robot_offload.partition.graph.ModelGraph` is classified as

    * ``elementwise`` -- each output element needs the same element of the input(s):
      activations, eval-mode batch norm, dropout, ``add``/``mul`` of equally sized tensors
      or of constants that do not vary along the rows, stochastic depth, ``permute``,
      concatenation along a dimension other than the rows;
    * ``rowwise`` -- each output row needs the same input row: ``Linear`` and ``LayerNorm``
      over trailing dimensions that do not include the rows (ConvNeXt's channels-last MLP),
      reductions over one other dimension (``argmax``, ``sum``, ``mean``, ...), and indexing
      of other dimensions with integers and constant slices (``x[:, 1:]``);
    * ``block`` -- output rows need a window of input rows, given by kernel, stride,
      padding and dilation: ``Conv2d``, ``Conv3d`` (rows on any of its spatial axes),
      ``MaxPool2d``, ``AvgPool2d``, ``ConvTranspose2d``, nearest ``Upsample`` by an
      integer factor;
    * ``reshape``/``view`` that regroups only the dimensions before and after the rows
      counts as elementwise (the rows keep their elements, in order);
    * ``global`` -- everything else (pooling to a fixed size, flatten/reshape, softmax,
      attention, a detection head kept as a leaf module, anything not recognised). A global
      operator needs its whole input, so spatial parts must be combined before it.

    "Rows" are one spatial axis of every tensor (``H`` of ``N x C x H x W``, ``D`` of
    ``N x C x D x H x W``; the axis is followed through ``permute``), the axis Intra-DP splits
    along. Being conservative is safe: an operator wrongly called global only costs
    parallelism; one wrongly called local would give wrong outputs, so unknown operators are
    global.

Regions and stripes
    A :class:`Region` is the part of the graph between two prefix cuts whose nodes are all
    local. A *stripe* is a range of output rows of every tensor leaving the region; the
    rows each node must compute for it follow by walking the region backwards through each
    operator's receptive field (:meth:`SpatialGraph.needs`). Neighbouring stripes overlap in
    the rows of block-wise operators near their boundary (the halo): both sides compute
    those rows, which is the recomputation Intra-DP trades for a transfer.

    :meth:`SpatialGraph.run` computes a stripe from row slabs of the region's inputs. Padding
    is applied only at the true tensor boundary: a convolution over rows ``[a, b)`` runs on
    input rows ``[a*s - p, (b-1)*s - p + d*(k-1) + 1)`` clipped to the tensor, with the
    clipped part replaced by the operator's padding value (zeros, or -inf for max pooling)
    and no row padding in the operator itself, so each output row is the same sum of the
    same products as in the full tensor. Results equal the whole-tensor computation up to
    floating-point summation order (the kernels may block the work differently).
"""

import math
import operator
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from robot_offload.partition.graph import Cut, CutError, ModelGraph, TensorMeta

Rows = Tuple[int, int]           # half-open row range [a, b)
Slab = Tuple[torch.Tensor, int]  # a tensor holding rows [r0, r0 + its row extent) of a full tensor

ELEMENTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.SiLU, nn.GELU, nn.Sigmoid, nn.Tanh, nn.Hardswish,
                       nn.Hardsigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Identity, nn.Dropout)
BATCHNORM_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
ELEMENTWISE_FUNCTIONS = {operator.add, operator.mul, operator.sub, operator.truediv,
                         torch.add, torch.mul, torch.sub, torch.div, torch.relu, torch.sigmoid,
                         torch.tanh, F.relu, F.relu6, F.silu, F.gelu, F.hardswish, F.sigmoid,
                         F.hardsigmoid, F.leaky_relu, F.dropout}
ELEMENTWISE_METHODS = {"relu", "sigmoid", "tanh", "add", "mul", "sub", "div", "contiguous",
                       "clone", "float", "half", "to"}
#: reductions over one named dimension: row-preserving when that dimension is not the rows
REDUCE_METHODS = {"argmax", "argmin", "sum", "mean", "amax", "amin"}
REDUCE_FUNCTIONS = {torch.argmax, torch.argmin, torch.sum, torch.mean, torch.amax, torch.amin}
RESHAPE_METHODS = {"reshape", "view"}


def _stochastic_depth():
    try:
        from torchvision.ops import stochastic_depth
        return stochastic_depth
    except ImportError:       # pragma: no cover - torchvision is a dependency
        return None


@dataclass(frozen=True)
class OpInfo:
    """How one node maps rows: ``kind`` (elementwise, rowwise, block, global), the row axis
    of its output (None if it has none), and for block-wise nodes the window."""

    kind: str
    row_axis: Optional[int]
    why: str = ""
    # block geometry along the rows
    op: str = ""              # conv, maxpool, avgpool, convT, upsample
    k: int = 1                # kernel size (upsample: the column factor)
    s: int = 1
    p: int = 0
    d: int = 1

    @property
    def local(self) -> bool:
        return self.kind != "global"


@dataclass(frozen=True)
class Region:
    """Nodes between two prefix cuts, all local: ``nodes`` run in a stripe; ``inputs`` are
    the tensors of the first cut, ``outputs`` those of the second (an input can be an
    output too, when a branch passes over the region)."""

    first: Cut
    last: Cut
    nodes: Tuple[str, ...]
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.first.id}|{self.last.id}"


class SpatialGraph:
    """Operator classes and row geometry of a graph recorded at one input shape."""

    def __init__(self, graph: ModelGraph, metas: Dict[str, TensorMeta]):
        self.graph = graph
        self.metas = metas
        self.info: Dict[str, OpInfo] = {}
        self._consts: Dict[str, Any] = {}
        self._last_uses_by_region: Dict[str, Dict[str, Tuple[str, ...]]] = {}
        sd = _stochastic_depth()
        self._elementwise_fns = set(ELEMENTWISE_FUNCTIONS) | ({sd} if sd is not None else set())
        for n in graph.nodes:
            k = graph.kinds[n.name]
            if k == "input":
                self.info[n.name] = OpInfo("input", self._default_axis(n.name))
            elif k == "data":
                self.info[n.name] = self._classify(n)

    # -- analysis -------------------------------------------------------------------------
    def _shape(self, name: str) -> Optional[Tuple[int, ...]]:
        m = self.metas.get(name)
        return m.shape if m is not None and m.is_tensor else None

    def _default_axis(self, name: str) -> Optional[int]:
        """Rows of a tensor made by a global node or the input: its first spatial axis, dim 2
        of ``N x C x H x W`` and ``N x C x D x H x W`` tensors (dim 1 of 3-d ones)."""
        shape = self._shape(name)
        if shape is None or len(shape) < 3:
            return None
        return 1 if len(shape) == 3 else 2

    def rows(self, name: str) -> int:
        """Row extent of tensor ``name``."""
        return self._shape(name)[self.axis(name)]

    def axis(self, name: str) -> int:
        info = self.info.get(name)
        if info is None or info.row_axis is None:
            raise CutError(f"tensor {name!r} has no row axis")
        return info.row_axis

    def kinds(self) -> Dict[str, str]:
        """Node name -> operator class, for data nodes."""
        return {n: i.kind for n, i in self.info.items() if i.kind != "input"}

    def _global(self, n, why: str) -> OpInfo:
        return OpInfo("global", self._default_axis(n.name), why)

    def _classify(self, n: torch.fx.Node) -> OpInfo:
        out = self._shape(n.name)
        if out is None:
            return OpInfo("global", None, "output is not a tensor")
        data = [a for a in n.all_input_nodes if self.graph.kinds[a.name] in ("input", "data")]
        reshape = ((n.op == "call_method" and n.target in RESHAPE_METHODS)
                   or (n.op == "call_function" and n.target is torch.reshape))
        if not reshape and any(self.graph.kinds[a.name] == "shape" for a in n.all_input_nodes):
            return self._global(n, "reads a shape")
        if not data:
            return self._global(n, "no data input")
        src = data[0].name
        src_info = self.info.get(src)
        if src_info is None or src_info.row_axis is None or self._shape(src) is None:
            return self._global(n, "input has no row axis")
        if any(self.info.get(a.name) is None or self.info[a.name].row_axis is None for a in data):
            return self._global(n, "an input has no row axis")
        ax = src_info.row_axis
        if ax == 0:
            return self._global(n, "rows are the batch axis")
        if reshape:
            return self._classify_reshape(n, data, ax, out)
        if n.op == "call_module":
            return self._classify_module(n, self.graph.gm.get_submodule(n.target), data, ax, out)
        if n.op == "call_function":
            return self._classify_function(n, data, ax, out)
        if n.op == "call_method":
            return self._classify_method(n, data, ax, out)
        return self._global(n, f"{n.op} node")

    def _same_rows(self, data, ax_out: int, out) -> bool:
        """Every data input has its rows at the output's row axis (right-aligned) with the
        output's extent."""
        for a in data:
            shape, info = self._shape(a.name), self.info[a.name]
            if shape is None or len(out) - len(shape) + info.row_axis != ax_out:
                return False
            if shape[info.row_axis] != out[ax_out]:
                return False
        return True

    def _consts_flat_along(self, n, ax_out: int, out) -> bool:
        """Constant tensor arguments do not vary along the rows (they broadcast)."""
        for a in n.all_input_nodes:
            if self.graph.kinds[a.name] != "const":
                continue
            v = self.const(a.name)
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                i = v.dim() - len(out) + ax_out
                if 0 <= i < v.dim() and v.shape[i] != 1:
                    return False
        return True

    def _elementwise(self, n, data, ax, out) -> OpInfo:
        ax_out = len(out) - len(self._shape(data[0].name)) + ax
        if not self._same_rows(data, ax_out, out):
            return self._global(n, "inputs differ along the rows")
        if not self._consts_flat_along(n, ax_out, out):
            return self._global(n, "a constant varies along the rows")
        return OpInfo("elementwise", ax_out)

    def _classify_module(self, n, m: nn.Module, data, ax, out) -> OpInfo:
        nd = len(out)
        if isinstance(m, ELEMENTWISE_MODULES):
            return self._elementwise(n, data, ax, out)
        if isinstance(m, BATCHNORM_MODULES):
            if m.training and m.track_running_stats is False:
                return self._global(n, "batch norm with batch statistics")
            if m.training:
                return self._global(n, "batch norm in training mode")
            return self._elementwise(n, data, ax, out)
        if isinstance(m, nn.Linear):
            if ax == nd - 1:
                return self._global(n, "linear over the rows")
            return OpInfo("rowwise", ax)
        if isinstance(m, nn.LayerNorm):
            if ax >= nd - len(m.normalized_shape):
                return self._global(n, "layer norm over the rows")
            return OpInfo("rowwise", ax)
        if isinstance(m, nn.Conv3d) and len(data) == 1 and nd == 5 and ax >= 2:
            return self._conv_info(n, m, ax)     # rows on any of D, H, W
        if len(data) != 1 or nd != 4 or ax != 2:
            return self._global(n, f"{type(m).__name__} not on N x C x H x W rows")
        if isinstance(m, nn.Conv2d) and not isinstance(m, nn.ConvTranspose2d):
            return self._conv_info(n, m, ax)
        if isinstance(m, nn.ConvTranspose2d):
            if m.padding_mode != "zeros":
                return self._global(n, f"padding mode {m.padding_mode}")
            return OpInfo("block", 2, op="convT", k=m.kernel_size[0], s=m.stride[0],
                          p=m.padding[0], d=m.dilation[0])
        if isinstance(m, nn.MaxPool2d):
            if m.ceil_mode or getattr(m, "return_indices", False):
                return self._global(n, "max pool with ceil mode or indices")
            return OpInfo("block", 2, op="maxpool", k=_pair(m.kernel_size)[0],
                          s=_pair(m.stride or m.kernel_size)[0], p=_pair(m.padding)[0],
                          d=_pair(m.dilation)[0])
        if isinstance(m, nn.AvgPool2d):
            p = _pair(m.padding)[0]
            if m.ceil_mode or (p and not m.count_include_pad):
                return self._global(n, "avg pool with ceil mode or padding not counted")
            return OpInfo("block", 2, op="avgpool", k=_pair(m.kernel_size)[0],
                          s=_pair(m.stride or m.kernel_size)[0], p=p)
        if isinstance(m, nn.Upsample):
            shape_in = self._shape(data[0].name)
            if m.mode != "nearest" or shape_in is None:
                return self._global(n, f"upsample mode {m.mode}")
            if out[2] % shape_in[2] or out[3] % shape_in[3]:
                return self._global(n, "upsample by a non-integer factor")
            return OpInfo("block", 2, op="upsample", s=out[2] // shape_in[2], k=out[3] // shape_in[3])
        return self._global(n, type(m).__name__)

    def _conv_info(self, n, m: nn.Module, ax: int) -> OpInfo:
        """A convolution's window along the rows (spatial dimension ``ax - 2``)."""
        if m.padding_mode != "zeros":
            return self._global(n, f"padding mode {m.padding_mode}")
        j = ax - 2
        k, s, d = m.kernel_size[j], m.stride[j], m.dilation[j]
        if isinstance(m.padding, str):
            if m.padding == "valid":
                p = 0
            elif s == 1 and (d * (k - 1)) % 2 == 0:
                p = d * (k - 1) // 2
            else:
                return self._global(n, "asymmetric 'same' padding")
        else:
            p = m.padding[j]
        return OpInfo("block", ax, op="conv", k=k, s=s, p=p, d=d)

    def _classify_reshape(self, n, data, ax, out) -> OpInfo:
        """``reshape``/``view`` that only regroups the dimensions before the rows and those
        after them: ``P x R x S`` to ``P' x R x S'`` with ``|P| = |P'|`` and ``|S| = |S'|``
        keeps every row's elements together, in order (AGRNav lifting BEV channels into
        ``C x Z`` before its 3D head). The target is the recorded output shape with the
        stripe's row count (:meth:`_compute`), so the shape values it reads do not matter."""
        if len(data) != 1:
            return self._global(n, "reshape of several tensors")
        shape_in = self._shape(data[0].name)
        rows = shape_in[ax]
        pre, post = math.prod(shape_in[:ax]), math.prod(shape_in[ax + 1:])
        for ax_out in range(1, len(out)):
            if out[ax_out] == rows and math.prod(out[:ax_out]) == pre and math.prod(out[ax_out + 1:]) == post:
                return OpInfo("elementwise", ax_out, "reshape", op="reshape")
        return self._global(n, "reshape mixes the rows with other dimensions")

    def _classify_reduce(self, n, data, ax, out) -> OpInfo:
        """A reduction over one dimension that is not the rows (``argmax(1)`` of per-class
        scores): each output row needs the same input row."""
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        keepdim = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        if len(data) != 1 or not isinstance(dim, int) or not isinstance(keepdim, bool):
            return self._global(n, "reduction over all or computed dimensions")
        nd_in = len(self._shape(data[0].name))
        dim %= nd_in
        if dim == ax:
            return self._global(n, "reduction over the rows")
        ax_out = ax - 1 if dim < ax and not keepdim else ax
        if ax_out == 0 or ax_out >= len(out) or out[ax_out] != self._shape(data[0].name)[ax]:
            return self._global(n, "reduction moves the rows")
        return OpInfo("rowwise", ax_out, "reduction")

    def _classify_getitem(self, n, data, ax, out) -> OpInfo:
        """Basic indexing that leaves the rows' dimension whole (``scores[:, 1:]``,
        ``x[0]``): every index an integer or a slice with constant integer bounds, the rows'
        one a full slice or absent. Each output row is then part of the same input row.
        Tensors, lists, ``None``, ``...`` and bounds computed in the graph are global."""
        if len(data) != 1 or len(n.args) != 2 or n.kwargs or n.args[0] is not data[0]:
            return self._global(n, "indexing with computed arguments")
        shape_in = self._shape(data[0].name)
        index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        if len(index) > len(shape_in):
            return self._global(n, "too many indices")
        dropped = 0
        for i, item in enumerate(index):
            if isinstance(item, slice):
                if not all(v is None or (isinstance(v, int) and not isinstance(v, bool))
                           for v in (item.start, item.stop, item.step)):
                    return self._global(n, "slice with computed bounds")
                if i == ax and item != slice(None):
                    return self._global(n, "indexing the rows")
            elif isinstance(item, int) and not isinstance(item, bool):
                if i == ax:
                    return self._global(n, "indexing the rows")
                dropped += i < ax
            else:
                return self._global(n, f"index {type(item).__name__}")
        ax_out = ax - dropped
        if ax_out == 0 or ax_out >= len(out) or out[ax_out] != shape_in[ax]:
            return self._global(n, "indexing moves the rows")
        return OpInfo("rowwise", ax_out, "index")

    def _classify_function(self, n, data, ax, out) -> OpInfo:
        t = n.target
        if t in self._elementwise_fns:
            return self._elementwise(n, data, ax, out)
        if t is torch.cat:
            return self._classify_cat(n, data, ax, out)
        if t in REDUCE_FUNCTIONS:
            return self._classify_reduce(n, data, ax, out)
        if t is operator.getitem:
            return self._classify_getitem(n, data, ax, out)
        if t is torch.permute:
            return self._classify_permute(n, ax, n.args[1] if len(n.args) > 1 else n.kwargs.get("dims"))
        if t is F.layer_norm:
            shape = n.args[1] if len(n.args) > 1 else n.kwargs.get("normalized_shape")
            if not isinstance(shape, (tuple, list)) or ax >= len(out) - len(shape):
                return self._global(n, "layer norm over the rows")
            return OpInfo("rowwise", ax)
        return self._global(n, getattr(t, "__name__", str(t)))

    def _classify_method(self, n, data, ax, out) -> OpInfo:
        t = n.target
        if t in ELEMENTWISE_METHODS:
            return self._elementwise(n, data, ax, out)
        if t in REDUCE_METHODS:
            return self._classify_reduce(n, data, ax, out)
        if t == "permute":
            dims = n.args[1:]
            if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
                dims = dims[0]
            return self._classify_permute(n, ax, dims)
        return self._global(n, f"method {t}")

    def _classify_permute(self, n, ax, dims) -> OpInfo:
        if not isinstance(dims, (tuple, list)) or not all(isinstance(d, int) for d in dims):
            return self._global(n, "permute with computed dims")
        nd = len(dims)
        dims = [d % nd for d in dims]
        new = dims.index(ax)
        if new == 0:
            return self._global(n, "rows moved to the batch axis")
        return OpInfo("elementwise", new, "permute")

    def _classify_cat(self, n, data, ax, out) -> OpInfo:
        tensors = n.args[0] if n.args else n.kwargs.get("tensors")
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        if not isinstance(dim, int) or not isinstance(tensors, (tuple, list)):
            return self._global(n, "cat with computed arguments")
        if any(not isinstance(t, torch.fx.Node) or self.graph.kinds[t.name] not in ("input", "data")
               for t in tensors):
            return self._global(n, "cat of constants")
        if dim % len(out) == ax:
            return self._global(n, "cat along the rows")
        return self._elementwise(n, data, ax, out)

    # -- constants ------------------------------------------------------------------------
    def const(self, name: str) -> Any:
        """The value of a const node (parameters, buffers, arithmetic on them)."""
        if name in self._consts:
            return self._consts[name]
        n = self.graph.by_name[name]
        if n.op == "get_attr":
            v = self.graph.gm
            for part in n.target.split("."):
                v = getattr(v, part)
        else:
            args = torch.fx.node.map_arg(n.args, lambda a: self.const(a.name))
            kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: self.const(a.name))
            v = _call(self.graph.gm, n, args, kwargs)
        self._consts[name] = v
        return v

    # -- regions ----------------------------------------------------------------------------
    def region(self, first: Cut, last: Cut) -> Region:
        """The region between prefix cuts ``first`` and ``last`` (``first`` earlier); raises
        :class:`CutError` if a node in between is global or a boundary tensor has no rows."""
        if not first.head <= last.head:
            raise CutError("the first cut of a region must come before the last")
        nodes = tuple(sorted(last.head - first.head, key=self.graph.index.__getitem__))
        if not nodes:
            raise CutError("the region is empty")
        for name in nodes:
            info = self.info[name]
            if not info.local:
                raise CutError(f"node {name!r} is global ({info.why})")
        for name in first.crossing + last.crossing:
            self.axis(name)
        return Region(first, last, nodes, first.crossing, last.crossing)

    def local_regions(self, cuts: List[Cut]) -> List[Region]:
        """Every region between two of ``cuts`` (prefix cuts in execution order)."""
        out = []
        for i, c1 in enumerate(cuts):
            for c2 in cuts[i + 1:]:
                try:
                    out.append(self.region(c1, c2))
                except CutError:
                    continue
        return out

    def split_rows(self, region: Region, fraction: float) -> Tuple[Dict[str, Rows], Dict[str, Rows]]:
        """The robot's stripe (top ``fraction`` of every output's rows) and the server's
        (the rest), as output name -> rows."""
        robot, server = {}, {}
        for name in region.outputs:
            h = self.rows(name)
            s = min(h, max(0, int(round(fraction * h))))
            robot[name], server[name] = (0, s), (s, h)
        return robot, server

    def needs(self, region: Region, out_rows: Dict[str, Rows]) -> Dict[str, Rows]:
        """Rows each region node must compute and each region input must hold so that the
        outputs' ``out_rows`` can be produced (empty ranges left out)."""
        need: Dict[str, Rows] = {}

        def add(name: str, rows: Rows) -> None:
            a, b = rows
            if a >= b:
                return
            if name in need:
                a0, b0 = need[name]
                need[name] = (min(a, a0), max(b, b0))
            else:
                need[name] = (a, b)

        for name, rows in out_rows.items():
            add(name, rows)
        in_region = set(region.nodes)
        for name in reversed(region.nodes):
            if name not in need:
                continue
            a, b = need[name]
            info = self.info[name]
            for arg in self.graph.by_name[name].all_input_nodes:
                if self.graph.kinds[arg.name] not in ("input", "data"):
                    continue
                if info.kind == "block":
                    rows = _block_need(info, a, b, self.rows(arg.name))
                else:
                    rows = (a, b)
                if arg.name in in_region or arg.name in region.inputs:
                    add(arg.name, rows)
                else:     # pragma: no cover - a prefix cut makes this impossible
                    raise CutError(f"{arg.name!r} is neither in the region nor crossing into it")
        return need

    def computed_fraction(self, region: Region, need: Dict[str, Rows]) -> Dict[str, float]:
        """Per region node, the share of its rows a stripe computes (halo included)."""
        return {n: (need[n][1] - need[n][0]) / self.rows(n) for n in region.nodes if n in need}

    # -- execution --------------------------------------------------------------------------
    def run(self, region: Region, need: Dict[str, Rows], held: Dict[str, Slab]) -> Dict[str, Slab]:
        """Compute a stripe: ``held`` maps each region input to a slab covering at least its
        ``need`` rows; returns every region output with a need, as a slab of exactly its
        needed rows."""
        have: Dict[str, Slab] = {}
        for name in region.inputs:
            if name not in need:
                continue
            if name not in held:
                raise CutError(f"the stripe needs rows {need[name]} of {name!r}, which is not held")
            have[name] = (self._crop(name, held[name], need[name]), need[name][0])
        free_after = self._last_uses(region)
        with torch.inference_mode():
            for name in region.nodes:
                if name in need:
                    have[name] = (self._compute(name, need[name], have), need[name][0])
                for done in free_after.get(name, ()):
                    have.pop(done, None)
        return {name: have[name] for name in region.outputs if name in need}

    def _last_uses(self, region: Region) -> Dict[str, Tuple[str, ...]]:
        """Region node -> the tensors no later region node reads and that are not region
        outputs: a stripe drops them there. Keeping every intermediate alive made the
        allocator hand out fresh pages for each one (a full-row KAPAO stripe took 1.4x
        the time of the same ops in the model's forward)."""
        cached = self._last_uses_by_region.get(region.id)
        if cached is not None:
            return cached
        last: Dict[str, str] = {}
        for name in region.nodes:
            for arg in self.graph.by_name[name].all_input_nodes:
                last[arg.name] = name
        keep = set(region.outputs)
        out: Dict[str, List[str]] = {}
        for tensor, reader in last.items():
            if tensor not in keep:
                out.setdefault(reader, []).append(tensor)
        cached = self._last_uses_by_region[region.id] = {k: tuple(v) for k, v in out.items()}
        return cached

    def _crop(self, name: str, slab: Slab, rows: Rows) -> torch.Tensor:
        t, r0 = slab
        ax = self.axis(name)
        a, b = rows
        if a < r0 or b > r0 + t.shape[ax]:
            raise CutError(f"slab of {name!r} holds rows [{r0}, {r0 + t.shape[ax]}), "
                           f"rows [{a}, {b}) are needed")
        return t.narrow(ax, a - r0, b - a)

    def _compute(self, name: str, rows: Rows, have: Dict[str, Slab]) -> torch.Tensor:
        n = self.graph.by_name[name]
        info = self.info[name]
        a, b = rows
        if info.kind == "block":
            src = next(x for x in n.all_input_nodes if self.graph.kinds[x.name] in ("input", "data"))
            ia, ib = _block_need(info, a, b, self.rows(src.name))
            x = self._crop(src.name, have[src.name], (ia, ib))
            if (ia, ib) == (0, self.rows(src.name)) and (a, b) == (0, self.rows(name)):
                # all rows from all rows: the module itself, its own padding and all, is
                # the op (no padded copy of the input; share-0 and full-row regions)
                return self.graph.gm.get_submodule(n.target)(x)
            return _run_block(self.graph.gm.get_submodule(n.target), info, x, ia, a, b,
                              self.rows(src.name))

        if info.op == "reshape":
            src = next(x for x in n.all_input_nodes if self.graph.kinds[x.name] in ("input", "data"))
            target = list(self._shape(name))
            target[info.row_axis] = b - a
            return self._crop(src.name, have[src.name], rows).reshape(target)

        def value(arg: torch.fx.Node):
            k = self.graph.kinds[arg.name]
            if k in ("input", "data"):
                return self._crop(arg.name, have[arg.name], rows)
            if k == "const":
                return self.const(arg.name)
            raise CutError(f"{name!r} reads {k} node {arg.name!r}")

        args = torch.fx.node.map_arg(n.args, value)
        kwargs = torch.fx.node.map_arg(n.kwargs, value)
        return _call(self.graph.gm, n, args, kwargs)


def _pair(v) -> Tuple[int, int]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def _call(gm: torch.fx.GraphModule, n: torch.fx.Node, args, kwargs):
    if n.op == "call_module":
        return gm.get_submodule(n.target)(*args, **kwargs)
    if n.op == "call_function":
        return n.target(*args, **kwargs)
    if n.op == "call_method":
        return getattr(args[0], n.target)(*args[1:], **kwargs)
    raise CutError(f"cannot evaluate a {n.op} node")


def _conv_without_row_padding(m: nn.Module, x: torch.Tensor, j: int) -> torch.Tensor:
    """``m`` (Conv2d or Conv3d) on ``x`` with its own padding except along spatial
    dimension ``j``, the rows, which the caller has padded where the tensor ends."""
    nsp = x.dim() - 2
    if isinstance(m.padding, str):
        pads = [0 if m.padding == "valid" else m.dilation[i] * (m.kernel_size[i] - 1) // 2
                for i in range(nsp)]
    else:
        pads = list(m.padding)
    pads[j] = 0
    conv = F.conv2d if nsp == 2 else F.conv3d
    return conv(x, m.weight, m.bias, stride=m.stride, padding=tuple(pads), dilation=m.dilation,
                groups=m.groups)


def _block_need(info: OpInfo, a: int, b: int, h_in: int) -> Rows:
    """Input rows (clipped to the tensor) that output rows ``[a, b)`` of a block-wise node read."""
    if info.op == "upsample":
        lo, hi = a // info.s, (b - 1) // info.s + 1
    elif info.op == "convT":
        # output row o sums input rows i with i*s - p + j*d == o, 0 <= j < k
        lo = -((-(a + info.p - info.d * (info.k - 1))) // info.s)     # ceil division
        hi = (b - 1 + info.p) // info.s + 1
    else:
        lo = a * info.s - info.p
        hi = (b - 1) * info.s - info.p + info.d * (info.k - 1) + 1
    return max(0, lo), min(h_in, max(hi, 0))


def _run_block(m: nn.Module, info: OpInfo, x: torch.Tensor, ia: int, a: int, b: int,
               h_in: int) -> torch.Tensor:
    """Output rows ``[a, b)`` of block-wise module ``m`` from input rows ``[ia, ia + x rows)``."""
    if info.op == "upsample":
        # nearest by integer factors copies rows and columns (k holds the column factor)
        y = x.repeat_interleave(info.s, dim=2).repeat_interleave(info.k, dim=3)
        return y.narrow(2, a - ia * info.s, b - a)
    if info.op == "convT":
        last = ia + x.shape[2] == h_in
        op_h = m.output_padding[0] if last else 0
        y = F.conv_transpose2d(x, m.weight, m.bias, stride=m.stride, padding=(0, m.padding[1]),
                               output_padding=(op_h, m.output_padding[1]), groups=m.groups,
                               dilation=m.dilation)
        first_row = ia * info.s - info.p          # full-tensor row of y's row 0
        return y.narrow(2, a - first_row, b - a)
    lo = a * info.s - info.p
    hi = (b - 1) * info.s - info.p + info.d * (info.k - 1) + 1
    pad_top, pad_bottom = max(0, -lo), max(0, hi - h_in)
    if pad_top or pad_bottom:
        fill = -math.inf if info.op == "maxpool" else 0.0
        # F.pad lists the last dimension first: nothing for those after the rows
        x = F.pad(x, (0, 0) * (x.dim() - 1 - info.row_axis) + (pad_top, pad_bottom), value=fill)
    if info.op == "conv":
        return _conv_without_row_padding(m, x, info.row_axis - 2)
    if info.op == "maxpool":
        k, s, p, d = (_pair(m.kernel_size), _pair(m.stride or m.kernel_size), _pair(m.padding),
                      _pair(m.dilation))
        return F.max_pool2d(x, k, s, padding=(0, p[1]), dilation=d, ceil_mode=False)
    if info.op == "avgpool":
        k, s, p = _pair(m.kernel_size), _pair(m.stride or m.kernel_size), _pair(m.padding)
        return F.avg_pool2d(x, k, s, padding=(0, p[1]), ceil_mode=False,
                            count_include_pad=m.count_include_pad,
                            divisor_override=m.divisor_override)
    raise CutError(f"unknown block op {info.op}")
