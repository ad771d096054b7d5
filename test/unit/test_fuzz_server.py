"""Fuzzing every handler of OffloadServer with hypothesis.

For ``load_model``, ``ping`` and ``compute`` with every entry registered in
the server's executors (``server.executors.CLASSES``) *when the test runs* (so executors added later are fuzzed without
touching this file), at least :data:`N_MALFORMED` malformed requests each: every one must
come back as a response of the right type with a non-OK status other than INTERNAL and a
text, never as an exception. A malformed request here carries at least one defect the
server must detect whatever the executor does with the rest (bad tensor headers, sizes,
codec names, bad JSON, oversized payloads, unknown models/entries, wrong field types), plus
random noise (stale session names, odd models, extra tensors). Valid requests interleaved
with the fuzz must still succeed with correct outputs. Well-formed but meaningless requests
(random valid tensors, random JSON objects, random sessions) are fuzzed too: those may
succeed, but must never raise. Memory: ``max_request_bytes`` is enforced before anything is
decoded, and RSS stays bounded over a long fuzz run.
"""

import gc
import json
import logging

import psutil
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from robot_offload import codec, compat
from robot_offload.codec import EncodedTensor
from robot_offload.models import registry
from robot_offload.server import executors as server_executors
from robot_offload.protocol import (ComputeRequest, ComputeResponse, LoadModelRequest,
                                    LoadModelResponse, PingRequest, PingResponse, StatusCode)
from robot_offload.server.request_check import MAX_ARGS_JSON_CHARS, MAX_ARGS_JSON_DEPTH, MAX_TENSORS
from robot_offload.server import OffloadServer, ServerConfig

from devices import SERVER_DEVICE, to_server

N_MALFORMED = 1000     # malformed requests per handler (and per compute entry)
N_WELLFORMED = 150     # well-formed, meaningless requests per compute entry
MAX_BYTES = 300_000    # the fuzzed server's max_request_bytes
SHAPE = (1, 3, 32, 32)
MODEL = "resnet18"
KNOWN_MODELS = set(registry.names())
FUZZ = settings(max_examples=N_MALFORMED, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
ENTRIES = sorted(cls.ENTRY for cls in server_executors.CLASSES)
MODEL_FREE_ENTRIES = {cls.ENTRY for cls in server_executors.CLASSES if not cls.NEEDS_MODEL}


@pytest.fixture(scope="module")
def fuzz_server():
    logging.getLogger("robot_offload").setLevel(logging.ERROR)   # thousands of refusals
    # One torch thread: between the occasional valid inference, idle OpenMP workers spin
    # and take the CPU from hypothesis on a small machine (3x slower here).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # A lop finish waits for its part (10 s by default); nonsense finishes have none.
    s = OffloadServer(ServerConfig(ops_sandbox=False, device=SERVER_DEVICE, max_request_bytes=MAX_BYTES, max_input_elements=100_000))
    s.executors["lop_part"].wait_s = 0.01
    assert s.handle("load_model", LoadModelRequest("fuzz", MODEL)).status == StatusCode.OK
    yield s
    torch.set_num_threads(threads)
    logging.getLogger("robot_offload").setLevel(logging.NOTSET)


class Valid:
    """Valid requests with known answers, sent every few fuzz examples."""

    def __init__(self, server):
        self.server = server
        self.x = torch.randn(SHAPE)
        self.frame = torch.randint(0, 256, (SHAPE[2], SHAPE[3], 3), dtype=torch.uint8)
        spec = registry.get_spec(MODEL)
        with torch.inference_mode():
            self.y = server.load(MODEL).module(to_server(self.x)).cpu()
            x_frame = registry.preprocess_image(self.frame.numpy(), SHAPE[2:], spec.mean, spec.std)
            self.y_frame = server.load(MODEL).module(to_server(x_frame)).cpu()
        self.count = 0
        self.sent = 0

    def tick(self, every=10):
        self.count += 1
        if self.count % every:
            return
        self.sent += 1
        r = self.server.handle("compute", ComputeRequest("fuzz", MODEL, "forward",
                                                          [codec.encode(self.x, "input")]))
        assert r.status == StatusCode.OK, r.status_text
        torch.testing.assert_close(codec.decode(r.tensors[0]), self.y)
        r = self.server.handle("compute", ComputeRequest("fuzz", MODEL, "forward_image",
                                                          [codec.encode(self.frame, "frame")],
                                                          args_json=json.dumps({"input_size": list(SHAPE[2:])})))
        assert r.status == StatusCode.OK, r.status_text
        torch.testing.assert_close(codec.decode(r.tensors[0]), self.y_frame)
        p = self.server.handle("ping", PingRequest("fuzz", b"ok"))
        assert p.status == StatusCode.OK and p.payload == b"ok"


@pytest.fixture(scope="module")
def valid(fuzz_server):
    return Valid(fuzz_server)


def _model_names():
    return st.text(max_size=40).filter(lambda n: n not in KNOWN_MODELS)


# -- strategies ------------------------------------------------------------------------------
def _good_tensor(shape=SHAPE, name="input"):
    return codec.encode(torch.randn(shape), name)


_BASE = _good_tensor()
_names = st.text(max_size=30)
_bad_codec = st.text(max_size=12).filter(lambda c: c not in codec.CODECS)
_bad_compression = st.text(max_size=12).filter(lambda c: c not in codec.COMPRESSIONS)
_bad_dtype = st.text(max_size=12).filter(lambda d: d not in codec._DTYPES)
_not_str = st.one_of(st.none(), st.integers(), st.binary(max_size=8), st.lists(st.integers(), max_size=3))
_not_int = st.one_of(st.none(), st.floats(allow_nan=True), st.text(max_size=5), st.lists(st.integers(), max_size=2))


@st.composite
def bad_tensor(draw):
    """An EncodedTensor with at least one defect in its header or size."""
    t = _BASE
    kind = draw(st.sampled_from([
        "truncate", "extend", "shape_lie", "huge_shape", "negative_dim", "too_many_dims",
        "dtype", "codec", "compression", "raw_size", "lossy_int", "int_params",
        "type_shape", "type_data", "type_text", "type_raw_size", "zstd_bomb"]))
    f = dict(name=t.name, dtype=t.dtype, shape=list(t.shape), codec=t.codec,
             compression=t.compression, scale=t.scale, zero_point=t.zero_point,
             raw_size=t.raw_size, data=t.data)
    n = len(t.data)
    if kind == "truncate":
        f["data"] = t.data[:draw(st.integers(0, n - 1))]
    elif kind == "extend":
        f["data"] = t.data + draw(st.binary(min_size=1, max_size=64))
    elif kind == "shape_lie":
        dims = draw(st.lists(st.integers(0, 64), min_size=0, max_size=6))
        assume(codec._numel(dims) * 4 != n)
        f["shape"] = dims
    elif kind == "huge_shape":
        f["shape"] = draw(st.lists(st.integers(1 << 16, 1 << 40), min_size=2, max_size=8))
        f["raw_size"] = draw(st.sampled_from([n, codec._numel(f["shape"]) * 4]))
    elif kind == "negative_dim":
        f["shape"] = [1, 3, -draw(st.integers(1, 1 << 31)), 32]
    elif kind == "too_many_dims":
        f["shape"] = [1] * draw(st.integers(codec.MAX_DIMS + 1, 64))
    elif kind == "dtype":
        f["dtype"] = draw(_bad_dtype)
    elif kind == "codec":
        f["codec"] = draw(_bad_codec)
    elif kind == "compression":
        f["compression"] = draw(_bad_compression)
    elif kind == "raw_size":
        f["raw_size"] = draw(st.integers(-(1 << 63), 1 << 64).filter(lambda r: r != n))
    elif kind == "lossy_int":
        f["dtype"] = draw(st.sampled_from(["int64", "int32", "uint8", "bool", "int8"]))
        f["codec"] = draw(st.sampled_from([c for c in codec.CODECS if c != "raw"]))
    elif kind == "int_params":
        q = codec.encode(torch.randn(SHAPE), "input", codec=draw(st.sampled_from(list(codec.INT_BITS))))
        f.update(codec=q.codec, raw_size=q.raw_size, data=q.data, zero_point=q.zero_point, scale=q.scale)
        if draw(st.booleans()):
            f["scale"] = draw(st.sampled_from([0.0, -1.0, float("nan"), float("inf"), -0.0]))
        else:
            f["zero_point"] = draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=256)))
    elif kind == "type_shape":
        f["shape"] = draw(st.one_of(st.just([1, 3, "32", 32]), st.just([1.0, 3, 32, 32]), st.just([None])))
    elif kind == "type_data":
        f["data"] = draw(st.one_of(st.text(max_size=8), st.none(), st.lists(st.integers(0, 255), max_size=4)))
    elif kind == "type_text":
        f[draw(st.sampled_from(["name", "dtype", "codec", "compression"]))] = draw(_not_str)
    elif kind == "type_raw_size":
        f["raw_size"] = draw(_not_int)
    elif kind == "zstd_bomb":
        # a few bytes of zstd claiming a tensor above max_request_bytes when decoded
        numel = draw(st.integers(MAX_BYTES // 4 + 1, 1 << 28))
        f.update(shape=[numel], compression="zstd", raw_size=numel * 4,
                 data=codec._zstd().ZstdCompressor().compress(b"\0" * 1024))
    return EncodedTensor(**f)


_ARGS = ["", "{}", " ", '{"cut": "input", "input_shape": [1, 3, 32, 32]}', '{"cut": ["nope"]}',
         '{"ops": []}', '{"a": [1, 2], "b": "c"}', '{"input_shape": [1, 3, 32, 32]}', '{"x": null}',
         # lop_part: valid arguments (resnet18's graph), nonsense tensors
         '{"phase": "prepare", "input_shape": [1, 3, 32, 32]}',
         '{"phase": "part", "frame": "0123456789ab", "first": ["x"], "last": ["layer1_1_relu_1"], '
         '"split": {"layer1_1_relu_1": 3}, "input_shape": [1, 3, 32, 32]}',
         '{"phase": "finish", "frame": "0123456789ab", "last": ["layer1_1_relu_1"], '
         '"input_shape": [1, 3, 32, 32]}',
         # forward_image: valid and out-of-bounds input sizes
         '{"input_size": [32, 32]}', '{"input_size": [8, 12]}', '{"input_size": [0, 32]}',
         '{"input_size": [4097, 2]}', '{"input_size": [1000, 1000]}', '{"input_size": [true, 8]}',
         '{"input_size": [32, 32], "x": 1}',
         # cancel: a well-formed id, and ids that are not
         '{"request_id": "0123456789abcdef"}', '{"request_id": "XYZ"}', '{"request_id": 7}']


@st.composite
def noise(draw):
    """Fields of a compute request that may be nonsense for an executor but are not
    malformed in themselves (cheap to draw: generation dominates the run time)."""
    return dict(
        session=draw(st.one_of(st.sampled_from(["", "stale-session-0", "s1", "x" * 128]), st.text(max_size=8))),
        args_json=draw(st.sampled_from(_ARGS)),
        output_codec=draw(st.sampled_from(codec.CODECS)),
        output_compression=draw(st.sampled_from(codec.COMPRESSIONS)),
        client_id=draw(st.sampled_from(["fuzz", "", "robot-1", "\u00e9\u0000"])),
    )


_BAD_JSON = st.one_of(
    st.text(max_size=30).filter(lambda s: s.strip() and not _is_json_object(s)),
    st.sampled_from(["[1, 2]", "3", '"x"', "null", "true", "{", '{"a": }', "{'a': 1}", "NaN",
                     "[" * 5000 + "]" * 5000, '{"a": ' * 3000 + "1" + "}" * 3000]),
    st.lists(st.integers(), max_size=5).map(json.dumps))


def _is_json_object(text):
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


@st.composite
def malformed_compute(draw, entry):
    """A compute request for ``entry`` with at least one defect the server must catch."""
    f = dict(model=MODEL, entry=entry, tensors=[_BASE], **draw(noise()))
    defects = draw(st.lists(st.sampled_from(
        ["tensor", "json", "output_codec", "output_compression", "text_type", "text_long",
         "too_large", "tensor_list", "unknown_model"]), min_size=1, max_size=3, unique=True))
    if "unknown_model" in defects and entry in MODEL_FREE_ENTRIES:
        defects = [d for d in defects if d != "unknown_model"] or ["tensor"]
    for d in defects:
        if d == "tensor":
            tensors = draw(st.lists(st.one_of(st.just(_BASE), bad_tensor()), min_size=0, max_size=3))
            f["tensors"] = tensors + [draw(bad_tensor())]
            f["tensors"] = draw(st.permutations(f["tensors"]))
        elif d == "json":
            f["args_json"] = draw(_BAD_JSON)
        elif d == "output_codec":
            f["output_codec"] = draw(st.one_of(_bad_codec, _not_str))
        elif d == "output_compression":
            f["output_compression"] = draw(st.one_of(_bad_compression, _not_str))
        elif d == "text_type":
            f[draw(st.sampled_from(["client_id", "model", "entry", "session", "args_json", "auth"]))] = draw(_not_str)
        elif d == "text_long":
            f[draw(st.sampled_from(["client_id", "model", "session", "auth"]))] = "x" * draw(
                st.integers(1025, 5000))
        elif d == "too_large":
            # several well-formed tensors whose sum exceeds max_request_bytes
            big = codec.encode(torch.zeros(MAX_BYTES // 8), "big")
            f["tensors"] = [big] * draw(st.integers(3, 6))
        elif d == "tensor_list":
            f["tensors"] = draw(st.one_of(st.none(), st.just("tensors"), st.just([None]), st.just([{"name": "x"}]),
                                          st.just((b"raw bytes",))))
        elif d == "unknown_model":
            f["model"] = draw(_model_names())
    return ComputeRequest(**f)


def _check_refused(resp, response_type, what):
    assert isinstance(resp, response_type), (what, type(resp))
    assert resp.status != StatusCode.OK, (what, resp)
    assert resp.status in set(StatusCode), (what, resp.status)
    assert resp.status != StatusCode.INTERNAL, (what, resp.status_text)
    assert isinstance(resp.status_text, str) and 0 < len(resp.status_text) <= 2000, what
    if isinstance(resp, ComputeResponse):
        assert resp.tensors == []


# -- the fuzz tests ------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ENTRIES)
def test_fuzz_compute_malformed(fuzz_server, valid, entry):
    seen = []

    @FUZZ
    @given(req=malformed_compute(entry))
    def run(req):
        seen.append(1)
        _check_refused(fuzz_server.handle("compute", req), ComputeResponse, req)
        valid.tick()

    run()
    assert len(seen) >= N_MALFORMED


def test_fuzz_compute_unknown_entries(fuzz_server, valid):
    seen = []

    @FUZZ
    @given(entry=st.text(max_size=30).filter(lambda e: e not in ENTRIES), kw=noise())
    def run(entry, kw):
        seen.append(1)
        r = fuzz_server.handle("compute", ComputeRequest(model=MODEL, entry=entry, tensors=[_BASE], **kw))
        _check_refused(r, ComputeResponse, entry)
        assert r.status == StatusCode.UNKNOWN_ENTRY
        valid.tick()

    run()
    assert len(seen) >= N_MALFORMED


@st.composite
def malformed_load(draw):
    kind = draw(st.sampled_from(["unknown", "hash", "type", "long", "wrong_request"]))
    if kind == "unknown":
        return LoadModelRequest(draw(st.text(max_size=20)), draw(_model_names()))
    if kind == "hash":
        return LoadModelRequest("fuzz", MODEL, weights_hash=draw(st.text(min_size=1, max_size=70)))
    if kind == "type":
        field = draw(st.sampled_from(["client_id", "model", "weights_hash", "auth"]))
        req = LoadModelRequest("fuzz", MODEL)
        setattr(req, field, draw(_not_str))
        return req
    if kind == "long":
        return LoadModelRequest("fuzz", "resnet" + "1" * draw(st.integers(1025, 4000)))
    return draw(st.one_of(st.none(), st.just(PingRequest("fuzz")), st.text(max_size=5),
                          st.just(ComputeRequest("fuzz", MODEL, "forward"))))


def test_fuzz_load_model_malformed(fuzz_server, valid):
    seen = []
    real_hash = fuzz_server.load(MODEL).weights_hash

    @FUZZ
    @given(req=malformed_load())
    def run(req):
        assume(getattr(req, "weights_hash", None) != real_hash)
        seen.append(1)
        _check_refused(fuzz_server.handle("load_model", req), LoadModelResponse, req)
        valid.tick()

    run()
    assert len(seen) >= N_MALFORMED * 0.95   # assume() may drop a few


def _refused_versions(text):
    """Whether a server refuses these versions: not readable, or another protocol."""
    try:
        return compat.Versions.from_json(text).protocol != compat.PROTOCOL_VERSION
    except compat.VersionsError:
        return True


@st.composite
def malformed_ping(draw):
    kind = draw(st.sampled_from(["large", "payload_type", "text_type", "long", "versions", "wrong_request"]))
    if kind == "large":
        return PingRequest("fuzz", b"\0" * draw(st.integers(MAX_BYTES + 1, MAX_BYTES + 4096)))
    if kind == "versions":       # what robot_offload.compat reads, malformed or of another protocol
        value = st.one_of(st.none(), st.integers(), st.text(max_size=70), st.lists(st.integers(), max_size=3),
                          st.dictionaries(st.text(max_size=30), st.text(max_size=20), max_size=3))
        keys = st.sampled_from(["package", "protocol", "torch", "torchvision", "device", "ops", "ops_differ", "x"])
        text = draw(st.one_of(
            st.text(min_size=1, max_size=50),
            st.dictionaries(keys, value, max_size=6).map(json.dumps),
            st.integers(2, 1 << 40).map(lambda v: json.dumps({"protocol": v, "torch": "2.1.2"}))
        ).filter(_refused_versions))
        return PingRequest("fuzz", b"", versions_json=text)
    if kind == "payload_type":
        return PingRequest("fuzz", draw(st.one_of(st.none(), st.text(max_size=5), st.integers(),
                                                   st.lists(st.integers(0, 255), max_size=3))))
    if kind == "text_type":
        req = PingRequest("fuzz", b"")
        setattr(req, draw(st.sampled_from(["client_id", "auth", "versions_json"])), draw(_not_str))
        return req
    if kind == "long":
        return PingRequest("x" * draw(st.integers(1025, 3000)), b"")
    return draw(st.one_of(st.none(), st.just(LoadModelRequest("fuzz", MODEL)), st.binary(max_size=5),
                          st.just(ComputeRequest("fuzz", MODEL, "forward"))))


def test_fuzz_ping_malformed(fuzz_server, valid):
    seen = []

    @FUZZ
    @given(req=malformed_ping())
    def run(req):
        seen.append(1)
        _check_refused(fuzz_server.handle("ping", req), PingResponse, req)
        valid.tick()

    run()
    assert len(seen) >= N_MALFORMED


@st.composite
def wellformed_compute(draw, entry):
    """Valid headers, nonsense content: any response is fine, an exception is not."""
    dtype = draw(st.sampled_from(["float32", "float16", "float64", "int64", "uint8", "bool"]))
    shape = draw(st.lists(st.integers(0, 12), min_size=0, max_size=5))
    if entry == "forward_image" and draw(st.booleans()):     # frame-like: [H, W] or [H, W, C]
        dtype = "uint8"
        shape = draw(st.lists(st.integers(0, 40), min_size=2, max_size=2)) + draw(
            st.lists(st.integers(1, 5), max_size=1))
    t = torch.zeros(shape, dtype=getattr(torch, dtype))
    if t.is_floating_point():
        t = torch.randn(shape).to(t.dtype)
    cdc = draw(st.sampled_from(codec.CODECS)) if t.is_floating_point() else "raw"
    tensors = [codec.encode(t, draw(_names), cdc, draw(st.sampled_from(codec.COMPRESSIONS)))]
    if draw(st.booleans()):
        tensors.append(_BASE)
    kw = draw(noise())
    kw["model"] = draw(st.one_of(st.just(MODEL), _model_names()))
    return ComputeRequest(entry=entry, tensors=draw(st.permutations(tensors)), **kw)


@pytest.mark.parametrize("entry", ENTRIES)
def test_fuzz_compute_wellformed_nonsense(fuzz_server, valid, entry):
    @settings(FUZZ, max_examples=N_WELLFORMED)
    @given(req=wellformed_compute(entry))
    def run(req):
        r = fuzz_server.handle("compute", req)
        assert isinstance(r, ComputeResponse) and r.status in set(StatusCode)
        if r.status == StatusCode.OK:
            for t in r.tensors:
                codec.decode(t)
        elif entry in ("forward", "forward_image", "partition_tail", "lop_part", "cancel"):
            assert r.status != StatusCode.INTERNAL, r.status_text   # built-ins: a clear error
        valid.tick(every=5)

    run()


def test_valid_requests_were_interleaved(valid):
    assert valid.sent >= 100


# -- limits and memory -------------------------------------------------------------------------
def test_max_request_bytes_enforced_before_decoding(fuzz_server):
    s = fuzz_server
    # wire bytes above the limit, one tensor
    big = codec.encode(torch.zeros(MAX_BYTES // 4 + 1), "x")
    assert s.handle("compute", ComputeRequest("t", MODEL, "forward", [big])).status == StatusCode.TOO_LARGE
    # several tensors, each below, together above
    part = codec.encode(torch.zeros(MAX_BYTES // 16), "x")
    r = s.handle("compute", ComputeRequest("t", MODEL, "forward", [part] * 5))
    assert r.status == StatusCode.TOO_LARGE and "max_request_bytes" in r.status_text
    # a zstd "bomb": 40 bytes on the wire, 4 GB decoded, refused without decompressing
    bomb = EncodedTensor("x", "float32", [1 << 30], compression="zstd", raw_size=4 << 30,
                         data=codec._zstd().ZstdCompressor().compress(b"\0" * 1024))
    r = s.handle("compute", ComputeRequest("t", MODEL, "forward", [bomb]))
    assert r.status == StatusCode.TOO_LARGE
    # compressed tensors that each decode below the limit but together above it
    z = codec.encode(torch.zeros(MAX_BYTES // 4 // 3 + 10), "z", compression="zstd")
    assert len(z.data) < 1000
    r = s.handle("compute", ComputeRequest("t", MODEL, "forward", [z] * 4))
    assert r.status == StatusCode.TOO_LARGE and "decoded" in r.status_text
    r = s.handle("compute", ComputeRequest("t", MODEL, "forward", [], args_json=" " * (MAX_ARGS_JSON_CHARS + 1)))
    assert r.status == StatusCode.TOO_LARGE
    r = s.handle("compute", ComputeRequest("t", MODEL, "forward", [EncodedTensor("x", "float32", [0])] * (MAX_TENSORS + 1)))
    assert r.status == StatusCode.TOO_LARGE
    assert s.handle("ping", PingRequest("t", b"\0" * (MAX_BYTES + 1))).status == StatusCode.TOO_LARGE


def test_args_json_depth_is_limited_on_every_python(fuzz_server):
    """Deeply nested args_json is refused by an explicit depth limit, not by whether this
    Python's json module happens to recurse that deep (3.11 refuses depth 3000, 3.12
    parses it); the limit itself still lets a forward through."""
    def nested(depth):
        return '{"a": ' * depth + "1" + "}" * depth

    for depth, ok in ((MAX_ARGS_JSON_DEPTH, True), (MAX_ARGS_JSON_DEPTH + 1, False), (3000, False)):
        r = fuzz_server.handle("compute", ComputeRequest("t", MODEL, "forward", [_BASE],
                                                         args_json=nested(depth)))
        assert (r.status == StatusCode.OK) == ok, (depth, r.status, r.status_text)
        if not ok:     # 3000 on 3.11: json's own RecursionError, also a BAD_REQUEST
            assert r.status == StatusCode.BAD_REQUEST, r.status_text
            assert depth > MAX_ARGS_JSON_DEPTH + 1 or "nests deeper" in r.status_text
    deep_list = "[" * (MAX_ARGS_JSON_DEPTH) + "]" * (MAX_ARGS_JSON_DEPTH)
    r = fuzz_server.handle("compute", ComputeRequest("t", MODEL, "forward", [_BASE],
                                                     args_json='{"a": ' + deep_list + "}"))
    assert r.status == StatusCode.BAD_REQUEST, r.status_text


def test_rss_stays_bounded_over_a_fuzz_run(fuzz_server, valid):
    """Thousands of refused requests (including near-limit payloads and bombs) and valid
    ones: the process's RSS may not grow by more than 40 MB after a warm-up."""
    proc = psutil.Process()
    near_limit = codec.encode(torch.zeros(MAX_BYTES // 4 - 16), "x")             # allowed size
    bomb = EncodedTensor("x", "float32", [1 << 30], compression="zstd", raw_size=4 << 30,
                         data=codec._zstd().ZstdCompressor().compress(b"\0" * 1024))
    lying = EncodedTensor("x", "float32", [1, 3, 1 << 20, 1 << 20], raw_size=3 << 42, data=b"\0" * 64)
    reqs = [ComputeRequest("t", MODEL, e, [t], args_json=a, session=f"s{i}")
            for i, (e, t, a) in enumerate((e, t, a) for e in ENTRIES for t in (near_limit, bomb, lying, _BASE)
                                          for a in ("{}", "[", '{"cut": "input", "input_shape": [1, 3, 32, 32]}'))]

    def burst(n):
        for i in range(n):
            fuzz_server.handle("compute", reqs[i % len(reqs)])
            fuzz_server.handle("ping", PingRequest("t", bytes(1000 + i % 7)))
            fuzz_server.handle("load_model", LoadModelRequest("t", f"nope{i}"))
            if i % 50 == 0:
                valid.tick(every=1)

    burst(300)                     # warm-up: caches, allocator pools, first executions
    gc.collect()
    before = proc.memory_info().rss
    burst(3000)
    gc.collect()
    grown = proc.memory_info().rss - before
    assert grown < 40 * 1024 * 1024, f"RSS grew by {grown / 2**20:.1f} MB over 3000 fuzz rounds"
