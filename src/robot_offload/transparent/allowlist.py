"""Which operators and argument values the offload server runs for a client.

The server runs operators a request names (:func:`~robot_offload.transparent.wire.resolve_op`).
The ``aten`` namespace holds far more than dense computation: sparse and quantized
tensors, storage tricks and printing, whose kernels trust their arguments' invariants. A
request can break those invariants (``_to_sparse`` then ``_indices`` then an in-place
``fill_`` of the indices, then ``_to_dense``: a write outside the tensor's memory), so the
server runs only the operators on an allow-list, :data:`ALLOWED_OPS`
(:mod:`~robot_offload.transparent.allowed_ops`): dense operators that real vision programs
reach, derived by running them (see :func:`derive`) and reviewed by hand.

:func:`check_op` refuses a name not on the list; :func:`check_arguments` refuses argument
values outside the dense world (sparse, quantized, nested or complex tensors, storages,
unknown objects) and, for the few allowed operators whose kernels trust a size or a value
of their arguments (``native_batch_norm``'s statistics, the boxes' image numbers of
``roi_align``/``roi_pool``, ``grid_sampler``'s modes), checks those (:data:`CALL_CHECKS`;
a replayed sequence runs them before each such call, :func:`call_check`). Both raise
:class:`~robot_offload.transparent.wire.WireError`, which the server answers with
BAD_REQUEST. The robot runs an operator that is not on the list (:func:`is_allowed`) itself
instead of sending it, as it does for a complex dtype argument (which
:func:`~robot_offload.transparent.wire.encode` does not carry).

Kept off the list, whatever a derivation finds (:data:`EXCLUDED_PATTERNS`): sparse
(``_to_sparse*``, ``_indices``, ``_values``, COO/CSR/...) and quantized operators
(``quantize_*``, ``int_repr``, ``dequantize``, ``q_*``), whose kernels trust index and
scale tensors a request could forge; storage tricks (``set_``, ``_set_*``, storages,
``resize_*``, ``_unsafe_*`` except matmul's ``_unsafe_view``, ``_fused_*``); I/O and
printing (``_print``, ``from_file``, ``save``); ``record_stream``, pinned memory, nested
tensors, MKL-DNN and cuDNN internals, complex views; ``empty``/``empty_like``/
``new_empty``, whose uninitialised bytes could be another session's data; and ``out=``
variants, which write (and may resize) a tensor the caller names. A robot program
still runs all of these: on the robot.

Deriving the list again (prints the Python literal of every aten/torchvision overload that
reaches a ``TorchDispatchMode`` while the registry models, the test programs and common
user-side tensor code run on the CPU; counts per source on stderr)::

    python -m robot_offload.transparent.allowlist --derive
"""

import re

import torch

from robot_offload.transparent import wire
from robot_offload.transparent.allowed_ops import ALLOWED_OPS

#: Families that never belong on the list, whatever a derivation finds: not dense
#: computation (sparse, quantized, nested tensors), storage and memory tricks, I/O and
#: printing. :func:`derive` reports and drops matches; a test checks the list against it.
EXCLUDED_PATTERNS = tuple(re.compile(p) for p in (
    # sparse layouts and their internals
    r"::_?to_sparse", r"::_indices", r"::_values", r"::indices", r"::values", r"sparse", r"_coo",
    r"_csr", r"_csc", r"_bsr", r"_bsc", r"::ccol", r"::crow", r"::row_indices", r"::col_indices",
    r"::_nnz",
    # quantized tensors
    r"quantiz", r"::q_", r"::int_repr", r"::dequantize", r"::fake_quant", r"_per_channel",
    r"_per_tensor", r"::_make_per",
    # storages, raw memory, uninitialised memory, views that bypass the usual checks
    r"::set_", r"::_set_", r"source_Storage", r"storage", r"::_unsafe_(?!view\.)", r"::_fused_",
    r"::resize", r"::_resize_output", r"::_reshape_alias", r"::data_ptr", r"::_version",
    r"::is_set_to", r"::empty", r"::new_empty", r"::_copy_from", r"record_stream", r"pin_memory",
    r"::_pin",
    # I/O and printing
    r"::_print", r"::from_file", r"::save", r"::_debug",
    # nested tensors, MKL-DNN and cuDNN internals, dual and complex views
    r"nested", r"::_mkldnn", r"::mkldnn", r"::to_mkldnn", r"::_cudnn", r"::_use_cudnn",
    r"::_make_dep", r"::_make_dual", r"::_unpack_dual", r"::view_as_complex", r"::view_as_real",
    r"::_conj", r"::_neg_view",
    # out= variants: they write (and may resize) a tensor the caller names; a program's out=
    # tensors are its own, so the robot runs these
    r"\.(\w+_)?out$",
))
#: Tensor dtypes an argument may have: the wire's, less complex ones (no listed operator
#: needs them; the codec carries none either).
ALLOWED_DTYPES = frozenset(d for d in wire._DTYPES.values() if not d.is_complex)


def is_excluded(name: str) -> bool:
    """Whether ``name`` belongs to a family :data:`EXCLUDED_PATTERNS` keeps off the list."""
    return any(p.search(name) for p in EXCLUDED_PATTERNS)


def canonical(name) -> str:
    """``aten::relu.default`` for an OpOverload, or for ``aten::relu`` / ``aten::relu.default``."""
    if isinstance(name, torch._ops.OpOverload):
        return wire.op_name(name)
    if isinstance(name, str) and "." not in name:
        return name + ".default"
    return name


def is_allowed(name_or_overload) -> bool:
    """Whether the server runs this operator (an OpOverload or its name)."""
    return canonical(name_or_overload) in ALLOWED_OPS


def check_op(name_or_overload) -> None:
    """Raise :class:`~robot_offload.transparent.wire.WireError` unless the operator is on
    the allow-list."""
    name = canonical(name_or_overload)
    if name not in ALLOWED_OPS:
        shown = name[:80] if isinstance(name, str) else type(name).__name__
        raise wire.WireError(f"operator {shown!r} is not on the server's allow-list of dense operators")


def check_tensor(t: torch.Tensor, where: str = "argument") -> None:
    """Refuse a tensor that is not a dense strided tensor of a real wire dtype."""
    if t.layout != torch.strided or t.is_sparse or t.is_nested or t.is_quantized or t.is_mkldnn:
        raise wire.WireError(f"{where}: only dense strided tensors are allowed, got layout {t.layout}"
                             + (" (quantized)" if t.is_quantized else ""))
    if t.dtype not in ALLOWED_DTYPES:
        raise wire.WireError(f"{where}: tensor dtype {t.dtype} is not allowed")


_PLAIN = (type(None), bool, int, float, str, torch.device, torch.memory_format)


def check_arguments(func, args, kwargs, placeholders: tuple = ()) -> None:
    """Refuse arguments of ``func`` outside the wire's dense world: every tensor (nested in
    lists too) dense, strided, not quantized, of a real wire dtype; dtype and layout values
    likewise; ``pin_memory`` never true; nothing but the wire's forms (numbers, booleans,
    strings, None, devices, memory formats, lists). Then, for the few operators whose
    kernels trust an argument's size or values (:data:`CALL_CHECKS`), that argument.

    ``placeholders`` are types that stand for a value filled in later (a compiled
    sequence's tensor slots and size symbols): they are accepted as they are and the
    operator's call check is left to the replay (:func:`call_check`)."""
    def name():             # only for a refusal's message: the usual call formats nothing
        return canonical(func) if isinstance(func, torch._ops.OpOverload) else str(func)[:80]

    stack = [args, list(kwargs.values()) if isinstance(kwargs, dict) else kwargs]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided or v.is_nested or v.dtype not in ALLOWED_DTYPES:
                check_tensor(v, f"{name()}: tensor argument")
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, torch.dtype):
            if v not in ALLOWED_DTYPES:
                raise wire.WireError(f"{name()}: dtype {v} is not allowed")
        elif isinstance(v, torch.layout):
            if v != torch.strided:
                raise wire.WireError(f"{name()}: layout {v} is not allowed")
        elif isinstance(v, _PLAIN) or (placeholders and isinstance(v, placeholders)):
            continue
        else:
            raise wire.WireError(f"{name()}: argument of type {type(v).__name__} is not allowed")
    if isinstance(func, torch._ops.OpOverload):
        pin = _pin_memory_position(func)
        if pin is not None and _arg(args, kwargs, pin, "pin_memory") is True:
            raise wire.WireError(f"{name()}: pin_memory is not allowed")
        if not placeholders:
            check = call_check(func)
            if check is not None:
                check(args, kwargs)


_PIN_POSITIONS = {}


def _pin_memory_position(func):
    try:
        return _PIN_POSITIONS[func]
    except KeyError:
        pos = next((i for i, a in enumerate(func._schema.arguments) if a.name == "pin_memory"), None)
        _PIN_POSITIONS[func] = pos
        return pos


def _arg(args, kwargs, i: int, name: str):
    return args[i] if i < len(args) else kwargs.get(name)


# -- operators whose kernels trust an argument ---------------------------------------------------
# An allowed operator can still read outside memory when its kernel skips a check that its
# public wrapper does (native_batch_norm reads running_mean[c] for every channel c, and
# dereferences missing running statistics in evaluation), or
# trusts values of its data (roi_align reads the image numbered by each box). These run
# before such an operator, on every path: the per-operator requests (check_arguments) and
# each replay of a sequence (call_check, bound when the sequence is compiled).

def _check_batch_norm(args, kwargs) -> None:
    # native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    x = _arg(args, kwargs, 0, "input")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise wire.WireError("aten::native_batch_norm: input must have a channel dimension")
    c = x.shape[1]
    for i, name in enumerate(("weight", "bias", "running_mean", "running_var"), start=1):
        t = _arg(args, kwargs, i, name)
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != c):
            raise wire.WireError(f"aten::native_batch_norm: {name} must be None or a vector of the "
                                 f"input's {c} channels")
    # In evaluation (training false) the kernel normalises with the running statistics
    # without checking that they exist: with neither, it dereferences null (a segfault).
    # The public batch_norm refuses that; a crafted call must not reach the kernel.
    if not _arg(args, kwargs, 5, "training") and (_arg(args, kwargs, 3, "running_mean") is None
                                                   or _arg(args, kwargs, 4, "running_var") is None):
        raise wire.WireError("aten::native_batch_norm: running_mean and running_var are needed "
                             "when training is false")


#: roi_align/roi_pool: box coordinates (times spatial_scale) beyond this many image sizes are
#: refused; legitimate boxes lie on or near the image.
ROI_EXTENT = 4
MAX_SAMPLING_RATIO = 64


def _check_rois(args, kwargs, align: bool) -> None:
    # roi_align(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)
    # roi_pool(input, rois, spatial_scale, pooled_height, pooled_width)
    op = "torchvision::roi_align" if align else "torchvision::roi_pool"
    x, rois = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "rois")
    scale = _arg(args, kwargs, 2, "spatial_scale")
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise wire.WireError(f"{op}: input must be N x C x H x W")
    if not isinstance(rois, torch.Tensor) or rois.dim() != 2 or rois.shape[1] != 5 or not rois.is_floating_point():
        raise wire.WireError(f"{op}: rois must be a K x 5 floating tensor")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 0 < abs(scale) < 1e6:
        raise wire.WireError(f"{op}: spatial_scale must be a finite non-zero number")
    if align:
        ratio = _arg(args, kwargs, 5, "sampling_ratio")
        if not isinstance(ratio, int) or ratio > MAX_SAMPLING_RATIO:
            raise wire.WireError(f"{op}: sampling_ratio must be an int <= {MAX_SAMPLING_RATIO}")
    if rois.numel() == 0:
        return
    limit = ROI_EXTENT * max(x.shape[2], x.shape[3], 1) / abs(scale)
    batch, coords = rois[:, 0], rois[:, 1:]
    ok = ((batch >= 0) & (batch < x.shape[0])).all() & (coords.abs() <= limit).all()
    if not bool(ok):      # NaN fails every comparison
        raise wire.WireError(f"{op}: every box needs a batch index in [0, {x.shape[0]}) and finite "
                             f"coordinates within {ROI_EXTENT} image sizes")


def _check_grid_sampler(args, kwargs) -> None:
    # grid_sampler[_2d](input, grid, interpolation_mode, padding_mode, align_corners)
    for i, name in ((2, "interpolation_mode"), (3, "padding_mode")):
        v = _arg(args, kwargs, i, name)
        if type(v) is not int or not 0 <= v <= 2:
            raise wire.WireError(f"grid_sampler: {name} must be 0, 1 or 2")


#: Operator name -> check of its call's arguments, run before the operator.
CALL_CHECKS = {
    "aten::native_batch_norm.default": _check_batch_norm,
    "torchvision::roi_align.default": lambda a, k: _check_rois(a, k, True),
    "torchvision::roi_pool.default": lambda a, k: _check_rois(a, k, False),
    "aten::grid_sampler.default": _check_grid_sampler,
    "aten::grid_sampler_2d.default": _check_grid_sampler,
}
_CALL_CHECK_OF = {}


def call_check(func):
    """The check ``check(args, kwargs)`` to run before each call of ``func``, or None."""
    try:
        return _CALL_CHECK_OF[func]
    except KeyError:
        check = _CALL_CHECK_OF[func] = CALL_CHECKS.get(canonical(func))
        return check


# -- deriving the list -------------------------------------------------------------------------

def derive(verbose: bool = True, sources=("registry", "programs", "habits")) -> dict:
    """{source: set of overload names} that reach a TorchDispatchMode while each source
    runs on the CPU: ``registry`` (every registry model's forward, eval mode, at its test
    input size), ``programs`` (the programs under ``test/programs``, two frames each, where
    the source tree is at hand) and ``habits`` (common user-side tensor code of vision
    programs, :func:`_habits`)."""
    import contextlib
    import os
    import runpy
    import sys
    import tempfile
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = {}

    class Record(TorchDispatchMode):
        def __init__(self, into):
            super().__init__()
            self.into = into

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = wire.op_name(func)
            if name.split("::")[0] in wire.NAMESPACES:
                self.into.add(name)
            return func(*args, **(kwargs or {}))

    def say(text):
        if verbose:
            print(text, file=sys.stderr, flush=True)

    from robot_offload.models import get_spec, names
    seen["registry"] = ops = set()
    for model_name in (names() if "registry" in sources else ()):
        spec = get_spec(model_name)
        model = spec.build()
        x = spec.example_input(spec.test_input_size)
        for ctx in (torch.no_grad, torch.inference_mode):
            with ctx(), Record(ops):
                model(x)
        say(f"registry {model_name}: {len(ops)} so far")

    seen["programs"] = ops = set()
    here = os.path.dirname(os.path.abspath(__file__))
    programs = os.path.join(here, "..", "..", "..", "test", "programs")
    if "programs" not in sources:
        pass
    elif os.path.isdir(programs):
        for prog in sorted(os.listdir(programs)):
            if not prog.endswith(".py"):
                continue
            with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
                saved = list(sys.argv)
                sys.argv = [prog, "--out", os.path.join(tmp, "out.npz"), "--frames", "2"]
                try:
                    with Record(ops):
                        runpy.run_path(os.path.join(programs, prog), run_name="__main__")
                finally:
                    sys.argv = saved
            say(f"program {prog}: {len(ops)} so far")
    else:
        say(f"no test programs at {programs}: skipped")

    seen["habits"] = ops = set()
    for grad in ((torch.no_grad, torch.inference_mode, torch.enable_grad) if "habits" in sources else ()):
        with grad(), Record(ops):
            _habits()
    say(f"habits: {len(ops)}")
    return seen


def _habits() -> None:
    """User-side tensor code a vision program commonly runs around (or instead of) a model:
    pre- and post-processing, detection heads, attention, training-mode layers."""
    import torch.nn.functional as F
    import torchvision

    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 16, 16, generator=g)
    logits = torch.randn(2, 10, generator=g)
    # classification heads
    torch.softmax(logits, 1), logits.log_softmax(1), logits.topk(3), logits.argmax(1), logits.argmax()
    logits.max(1), logits.max(), logits.min(), logits.sort(1), logits.argsort(1, descending=True)
    logits.softmax(-1).max().item(), logits.argmax(1).tolist(), float(logits.sum()), int(logits.argmax())
    torch.sigmoid(x), x.sigmoid_().clone(), torch.tanh(x), F.log_softmax(logits, -1)
    # resizing
    F.interpolate(x, scale_factor=2, mode="nearest"), F.interpolate(x, size=(20, 20), mode="nearest")
    F.interpolate(x, size=(20, 20), mode="bilinear", align_corners=False)
    F.interpolate(x, scale_factor=0.5, mode="bilinear", align_corners=True)
    F.interpolate(x, size=(8, 8), mode="bicubic", align_corners=False), F.interpolate(x, size=(8, 8), mode="area")
    torch.nn.Upsample(scale_factor=2)(x), torch.nn.UpsamplingBilinear2d(scale_factor=2)(x)
    # detection post-processing
    boxes = torch.rand(20, 4, generator=g) * 30
    boxes[:, 2:] += boxes[:, :2]
    scores = torch.rand(20, generator=g)
    classes = torch.randint(0, 3, (20,), generator=g)
    torchvision.ops.nms(boxes, scores, 0.5), torchvision.ops.batched_nms(boxes, scores, classes, 0.5)
    torchvision.ops.box_iou(boxes, boxes), torchvision.ops.clip_boxes_to_image(boxes, (16, 16))
    torchvision.ops.remove_small_boxes(boxes, 1.0), torchvision.ops.box_convert(boxes, "xyxy", "cxcywh")
    rois = torch.cat([torch.zeros(20, 1), boxes / 4], 1)
    torchvision.ops.roi_align(x, rois[:4], (4, 4), 1.0, 2), torchvision.ops.roi_align(x, [boxes[:3], boxes[3:5]], 4)
    torchvision.ops.roi_pool(x, rois[:4], (4, 4), 1.0)
    keep = scores > 0.5
    boxes[keep], scores[keep], torch.where(keep), torch.where(keep, scores, torch.zeros_like(scores))
    torch.where(keep, scores, 0.0), torch.masked_select(scores, keep), keep.nonzero(), keep.nonzero(as_tuple=True)
    scores.masked_fill(keep, 0), keep.sum(), keep.any(), keep.all(), (scores > 0.2) & keep, ~keep, keep | keep
    boxes.clamp(0, 16), boxes.clamp(min=0), boxes.clamp(max=16), boxes.clamp_(0, 16), scores.clamp_min(0.1)
    torch.stack([boxes, boxes]), torch.cat([boxes, boxes], 0), torch.cat((scores[:, None], boxes), 1)
    scores.unique(), torch.meshgrid(torch.arange(4), torch.arange(3), indexing="ij"), torch.arange(0, 8, 2.0)
    torch.linspace(0, 1, 5), torch.full((2, 2), 3.0), torch.eye(3), torch.tensor([1.0, 2.0]), torch.as_tensor([1, 2])
    # normalisation and activations
    F.normalize(logits, dim=1), (x - x.mean((2, 3), keepdim=True)) / (x.std((2, 3), keepdim=True) + 1e-5)
    x.var(1), x.std(), F.layer_norm(x, (16,)), F.group_norm(x, 3), F.instance_norm(x)
    F.batch_norm(x, torch.zeros(3), torch.ones(3)), F.local_response_norm(x, 2)
    for act in (F.gelu, F.silu, F.hardswish, F.hardsigmoid, F.relu6, F.leaky_relu, F.elu, F.mish,
                F.softplus, torch.relu, F.relu_, F.hardtanh, F.prelu, F.sigmoid, F.softsign, F.selu):
        act(x.clone()) if act is not F.prelu else act(x, torch.ones(1))
    F.gelu(x, approximate="tanh"), F.silu(x.clone(), inplace=True), F.hardswish(x.clone(), inplace=True)
    F.leaky_relu(x.clone(), inplace=True), F.relu6(x.clone(), inplace=True), F.glu(x, 3)
    # dropout (eval: nothing; train: random masks), batch norm in train mode, random numbers
    for train in (False, True):
        F.dropout(x, 0.5, train), F.dropout2d(x, 0.5, train), F.alpha_dropout(x, 0.5, train)
        bn = torch.nn.BatchNorm2d(3).train(train)
        bn(x)
    torch.randn(2, 3), torch.rand(2, 3), torch.randint(0, 5, (3,)), torch.randn_like(x), torch.rand_like(x)
    torch.randperm(5), torch.bernoulli(torch.full((3,), 0.5)), torch.multinomial(torch.ones(4), 2)
    torch.empty(3).uniform_(), torch.empty(3).normal_(), torch.normal(torch.zeros(3), 1.0), torch.manual_seed(0)
    # dtype conversions
    x.half().float(), x.bfloat16().float(), x.double(), x.long(), x.int(), x.bool(), x.to(torch.uint8)
    x.to(torch.float16), (x * 255).byte(), x.type(torch.float64), x.type_as(logits), x.to("cpu")
    torch.zeros(2, dtype=torch.int8), torch.zeros(2, dtype=torch.int16)
    # indexing
    idx = torch.tensor([0, 1])
    y = x.clone()
    y[idx], y[:, idx], y[idx, idx], y.index_select(1, idx), y[..., 1:3], y[:, None], y[0, 1, 2]
    y[idx] = 0.0
    y[idx, :, 0] = 1.0
    y[y > 0.5] = 0.0
    y.index_put_((idx,), torch.zeros(2, 3, 16, 16)), y.index_fill(1, idx, 0), y.index_add(0, idx, y[:2])
    y[:, :, 2:4, 2:4] = 1.0
    torch.gather(logits, 1, logits.argmax(1, keepdim=True)), logits.scatter(1, idx[None].expand(2, 2), 0.0)
    logits.scatter_add(1, idx[None].expand(2, 2), logits[:, :2]), logits.scatter_(1, idx[None].expand(2, 2), 1.0)
    torch.zeros(5).scatter_reduce(0, idx, torch.ones(2), "amax"), torch.take(logits, idx)
    torch.zeros(4).index_copy(0, idx, torch.ones(2)), logits.masked_scatter(logits > 0, logits)
    # linear algebra and attention
    a, b = torch.randn(2, 4, 5), torch.randn(2, 5, 3)
    torch.einsum("bij,bjk->bik", a, b), torch.bmm(a, b), a @ b, a[0] @ b[0], torch.matmul(a[0], b[0, :, 0])
    torch.baddbmm(torch.zeros(2, 4, 3), a, b), torch.addmm(torch.zeros(4, 3), a[0], b[0]), torch.mm(a[0], b[0])
    F.linear(a, torch.randn(6, 5), torch.randn(6)), F.linear(a, torch.randn(6, 5)), torch.outer(idx.float(), idx.float())
    q = torch.randn(1, 2, 8, 4)
    F.scaled_dot_product_attention(q, q, q), F.scaled_dot_product_attention(q, q, q, is_causal=True)
    F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    torch.nn.MultiheadAttention(4, 2, batch_first=True).eval()(q[0], q[0], q[0])
    torch.cdist(a, a), torch.norm(a), a.norm(dim=1), torch.linalg.vector_norm(a, dim=-1), torch.dist(a, a)
    # spatial transforms
    F.pixel_shuffle(torch.randn(1, 8, 4, 4), 2), F.pixel_unshuffle(x, 2)
    grid = F.affine_grid(torch.eye(2, 3)[None].expand(2, 2, 3), (2, 3, 8, 8), align_corners=False)
    F.grid_sample(x, grid, align_corners=False), F.grid_sample(x, grid, mode="nearest", align_corners=True)
    F.grid_sample(x, grid, padding_mode="border", align_corners=False)
    F.pad(x, (1, 1, 1, 1)), F.pad(x, (1, 1, 1, 1), mode="reflect"), F.pad(x, (1, 1, 1, 1), mode="replicate")
    F.pad(x, (1, 1, 1, 1), value=0.5), F.pad(x, (1, 1, 1, 1), mode="circular")
    # pooling and convolution
    F.max_pool2d(x, 2), F.max_pool2d(x, 3, 2, 1), F.max_pool2d(x, 2, return_indices=True), F.avg_pool2d(x, 2)
    F.avg_pool2d(x, 3, 1, 1, count_include_pad=False), F.adaptive_avg_pool2d(x, 1), F.adaptive_avg_pool2d(x, (3, 5))
    F.adaptive_max_pool2d(x, 2), F.max_pool1d(x[:, :, 0], 2), F.avg_pool1d(x[:, :, 0], 2), F.adaptive_avg_pool1d(x[0], 2)
    F.conv2d(x, torch.randn(4, 3, 3, 3)), F.conv2d(x, torch.randn(6, 1, 3, 3), padding=1, groups=3)
    F.conv_transpose2d(x, torch.randn(3, 4, 2, 2), stride=2), F.conv1d(x[:, :, 0], torch.randn(4, 3, 3))
    F.conv3d(x[:, :, None], torch.randn(2, 3, 1, 3, 3)), F.max_pool3d(x[:, :, None], (1, 2, 2))
    torch.nn.Conv2d(3, 4, 3, padding_mode="reflect")(x), F.unfold(x, 3), F.fold(F.unfold(x, 2, stride=2), (16, 16), 2, stride=2)
    F.embedding(idx, torch.randn(4, 3))
    # views and copies
    x.view(2, 3, -1), x.reshape(6, -1), x.permute(0, 2, 3, 1).contiguous(), x.transpose(1, 2), x.mT, logits.t()
    z = x.clone()
    z.copy_(x), z[0].copy_(x[1]), z.zero_(), z.fill_(1.0), z.add_(x), z.mul_(2), z.sub_(x), z.div_(2), z.masked_fill_(z > 1, 0)
    x[:, :1].expand(2, 3, 16, 16), x.expand_as(x), x.flatten(1), x.unsqueeze(0), x[None].squeeze(0), x.squeeze()
    x.unbind(1), x.split(1, 1), x.split([1, 2], 1), x.chunk(2, 2), x.narrow(2, 0, 4), x.select(1, 0), x.flip(3)
    x.roll(1, 2), x.repeat(1, 2, 1, 1), x.tile((1, 2)), x.repeat_interleave(2, dim=1), x.movedim(1, -1), x.unflatten(1, (3, 1))
    x.view_as(x), x.reshape_as(x), x.as_strided((2, 2), (1, 1)), x.detach(), x.numpy(), torch.from_numpy(x.numpy())
    x.contiguous(memory_format=torch.channels_last), x.new_zeros(3), x.new_ones(3), x.new_full((2,), 1.0), x.new_empty(3)
    x.new_tensor([1.0]), torch.zeros_like(x), torch.ones_like(x), torch.full_like(x, 2), torch.empty_like(x)
    torch.triu(logits), torch.tril(logits), logits.diagonal(), torch.diag(idx)
    # elementwise arithmetic and reductions
    for f in (torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.abs, torch.neg, torch.floor, torch.ceil,
              torch.round, torch.sign, torch.reciprocal, torch.sin, torch.cos, torch.trunc, torch.log1p, torch.expm1,
              torch.log2, torch.exp2, torch.frac, torch.square, torch.sgn, torch.erf, torch.atan, torch.tan,
              torch.asin, torch.acos, torch.sinh, torch.cosh, torch.log10, torch.isnan, torch.isfinite, torch.isinf):
        f(x)
    x + 1, x - x, x * 2.0, x / 3, x // 2, x % 2, x ** 2, 2 ** x, x.pow(0.5), 1 - x, 1 / (x + 1), -x, abs(x)
    torch.atan2(x, x), torch.maximum(x, x), torch.minimum(x, x), torch.max(x, x), torch.fmod(x, 2), torch.remainder(x, 2)
    x.sum(), x.sum(1), x.mean(), x.mean(1, keepdim=True), x.prod(1), x.cumsum(1), x.cumprod(1), x.amax((2, 3)), x.amin(1)
    x.max(1), x.min(1), x.median(), x.logsumexp(1), x.std(1), torch.var_mean(x, 1), torch.std_mean(x, 1), x.kthvalue(2, 1), x.count_nonzero()
    x == x, x != 0, x > 0, x < 1, x >= 0, x <= 1, x > x, x < x, x >= x, x != x, x.sub(1), x.div(2), x.clone().sub_(1), torch.isclose(x, x), torch.allclose(x, x), torch.equal(x, x)
    torch.logical_and(keep, keep), torch.logical_or(keep, keep), torch.logical_not(keep), torch.logical_xor(keep, keep)
    idx & 1, idx | 1, idx ^ 1, idx << 1, idx >> 1, idx.bitwise_not(), torch.lerp(x, x, 0.5), torch.addcmul(x, x, x)
    torch.bucketize(scores, torch.tensor([0.2, 0.5])), torch.searchsorted(torch.tensor([0.2, 0.5]), scores)
    torch.histc(scores, 4), x.clone().clamp_(max=0.5), x.floor_divide(2), x.sign()
    torch.nan_to_num(x), x.clip(0, 1), torch.cummax(x, 1), torch.diff(scores), torch.flatten(x), torch.hypot(x, x)
    # training-mode layers (their forward: the robot offloads inference, not backward passes)
    if torch.is_grad_enabled():
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                  torch.nn.Dropout(0.1), torch.nn.Flatten(), torch.nn.Linear(4 * 14 * 14, 2)).train()
        net(x)


def _main(argv=None) -> int:
    import argparse
    import sys
    ap = argparse.ArgumentParser(prog="python -m robot_offload.transparent.allowlist", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--derive", action="store_true",
                    help="print the derived list as a Python literal (counts and dropped families on stderr)")
    args = ap.parse_args(argv)
    if not args.derive:
        ap.print_help()
        return 2
    seen = derive()
    union = set().union(*seen.values())
    dropped = sorted(n for n in union if is_excluded(n))
    kept = sorted(n for n in union if not is_excluded(n))
    for src, ops in seen.items():
        print(f"{src}: {len(ops)} overloads ({len(ops - set().union(*(v for k, v in seen.items() if k != src)))} "
              "only there)", file=sys.stderr)
    print(f"union: {len(union)}; dropped by EXCLUDED_PATTERNS: {len(dropped)} {dropped}", file=sys.stderr)
    print(f"derived but not in ALLOWED_OPS: {sorted(set(kept) - ALLOWED_OPS)}", file=sys.stderr)
    print(f"in ALLOWED_OPS but not derived: {sorted(ALLOWED_OPS - set(kept))}", file=sys.stderr)
    print("ALLOWED_OPS = frozenset({")
    for n in kept:
        print(f"    {n!r},  # " + ", ".join(src for src, ops in seen.items() if n in ops))
    print("})")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
