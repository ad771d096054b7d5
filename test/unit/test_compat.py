"""The version rule between robot and server (robot_offload.compat), without a server:
protocol equality, operator schemas compared as torch binds calls, the bounds on what the
other side sends, and the protocol version moving with the services' definitions."""

import dataclasses
import hashlib
import json
import pathlib
import re

import pytest
import torch

from robot_offload import compat
from robot_offload.errors import Incompatible
from robot_offload.transparent.allowed_ops import ALLOWED_OPS

pytestmark = pytest.mark.robot_side

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: protocol version -> digest of the client/server definitions it names (comments and
#: spacing aside, as ROS's own md5sums). A change to them needs a new version here and
#: in compat.PROTOCOL_VERSION.
RECORDED_WIRE = {1: "16b7236404fe6a56012a8a98c71e05eab2e94b2aff6b829526b553d4dadf08f7",
                 2: "e4a02eed3b73b57491e6ab289261bec405f5986a635afe18aba458823f979db2",
                 3: "58b1bf9f994c5f17b0f2e710286bee1e6df4119f25e61a24c70781edc2a626e5",
                 4: "a4097544947933376c4d8a4f42000ea32a499f7f3e71d9c2886bdf029f716eed"}
WIRE_FILES = ("msg/Status.msg", "msg/Tensor.msg", "srv/Compute.srv", "srv/LoadModel.srv", "srv/Ping.srv")

# One operator's schema as torch 2.1 prints it and as later releases do (SymInt, defaults
# written out), and one that gained a keyword argument with a default.
CONV_21 = ("aten::conv2d(Tensor input, Tensor weight, Tensor? bias=None, int[2] stride=1, "
           "SymInt[2] padding=[0, 0], int[2] dilation=1, int groups=1) -> Tensor")
CONV_LATER = ("aten::conv2d(Tensor input, Tensor weight, Tensor? bias=None, SymInt[2] stride=[1, 1], "
              "SymInt[2] padding=[0, 0], SymInt[2] dilation=[1, 1], SymInt groups=1) -> Tensor")
SDPA_21 = ("aten::scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, "
           "Tensor? attn_mask=None, float dropout_p=0., bool is_causal=False, *, float? scale=None) -> Tensor")
SDPA_LATER = SDPA_21.replace("float? scale=None)", "float? scale=None, bool enable_gqa=False)")


def _v(protocol=compat.PROTOCOL_VERSION, torch_version="2.1.2", **kw):
    return compat.Versions(package="0.1.0", protocol=protocol, torch=torch_version, **kw)


def _schema(text):
    return torch._C.parse_schema(text)


def test_the_protocol_version_names_these_definitions():
    h = hashlib.sha256()
    for rel in WIRE_FILES:
        h.update(rel.encode() + b"\n")
        for line in (ROOT / rel).read_text().splitlines():
            line = re.sub(r"\s+", " ", line.split("#", 1)[0]).strip()
            if line:
                h.update(line.encode() + b"\n")
    assert RECORDED_WIRE.get(compat.PROTOCOL_VERSION) == h.hexdigest(), (
        f"{', '.join(WIRE_FILES)} changed: bump compat.PROTOCOL_VERSION and record "
        f"{compat.PROTOCOL_VERSION + 1}: {h.hexdigest()!r} in RECORDED_WIRE")


def test_another_protocol_is_refused_naming_both_versions():
    client, server = _v(protocol=1), _v(protocol=2, torch_version="2.14.1")
    text = compat.protocol_refusal(client, server)
    assert "protocol 1 (robot_offload 0.1.0, torch 2.1.2)" in text
    assert "protocol 2 (robot_offload 0.1.0, torch 2.14.1)" in text
    assert compat.protocol_refusal(client, _v(protocol=1, torch_version="2.14.1")) is None
    with pytest.raises(Incompatible, match="protocol 2") as e:
        compat.checked_server_versions(client, server.to_json())
    assert "protocol 1" in e.value.text
    with pytest.raises(Incompatible, match="no usable versions.*predates"):
        compat.checked_server_versions(client, "")          # a server before the exchange


def test_schemas_compare_as_torch_binds_calls():
    """torch 2.1's and later printings of conv2d bind every call alike: one digest. A
    later sdpa (a trailing keyword with a default) reads a 2.1 client's calls, not the
    other way round."""
    assert compat.schema_text(_schema(CONV_21)) == compat.schema_text(_schema(CONV_LATER))
    old, new = _schema(SDPA_21), _schema(SDPA_LATER)
    old_digest = compat.schema_digest(compat.schema_text(old))
    new_digest = compat.schema_digest(compat.schema_text(new))
    assert old_digest != new_digest
    assert old_digest in compat.accepted_schema_digests(new)
    assert new_digest not in compat.accepted_schema_digests(old)
    # an argument of another type, name or default, or a write, is another schema
    for changed in (CONV_21.replace("int groups=1", "float groups=1"),
                    CONV_21.replace("int groups=1", "int groups=2"),
                    CONV_21.replace("Tensor input", "Tensor self"),
                    CONV_21.replace("Tensor input", "Tensor(a!) input")):
        assert (compat.schema_digest(compat.schema_text(_schema(changed)))
                not in compat.accepted_schema_digests(_schema(CONV_21))), changed


def test_differing_ops_name_the_operator_and_why():
    conv, sdpa = "aten::conv2d.default", "aten::scaled_dot_product_attention.default"
    accepted = {conv: compat.accepted_schema_digests(_schema(CONV_21)),
                sdpa: compat.accepted_schema_digests(_schema(SDPA_21)),
                "aten::gone.default": frozenset()}
    schemas = {conv: compat.schema_text(_schema(CONV_21)), sdpa: compat.schema_text(_schema(SDPA_21))}
    client = _v(torch_version="2.14.1", ops={
        conv: compat.schema_digest(compat.schema_text(_schema(CONV_LATER))),
        sdpa: compat.schema_digest(compat.schema_text(_schema(SDPA_LATER))),
        "aten::gone.default": "0" * 16, "aten::other.default": "1" * 16})
    differ = compat.differing_ops(client, accepted, schemas)
    assert sorted(differ) == ["aten::gone.default", "aten::other.default", sdpa]
    assert "enable_gqa" not in differ[sdpa] and "scale=None" in differ[sdpa]
    assert "no such operator" in differ["aten::gone.default"]
    assert "allow-list" in differ["aten::other.default"]
    server = dataclasses.replace(_v(), ops_differ=differ)
    refusals = compat.op_refusals(client, server)
    assert set(refusals) == set(differ)
    assert "torch 2.1.2" in refusals[sdpa] and "torch 2.14.1" in refusals[sdpa] and sdpa in refusals[sdpa]


def test_local_versions_cover_the_allow_list_this_torch_has():
    mine = compat.local_versions()
    assert mine.protocol == compat.PROTOCOL_VERSION and mine.torch == torch.__version__
    assert set(mine.ops) <= ALLOWED_OPS and "aten::convolution.default" in mine.ops
    assert len(mine.ops) >= len(ALLOWED_OPS) - 5        # a few of a later torch at most
    # this torch reads its own calls alike; the round trip through JSON keeps everything
    assert compat.differing_ops(mine, compat.accepted_digests(), compat.op_schemas()) == {}
    assert compat.Versions.from_json(mine.to_json()) == mine
    assert len(mine.to_json()) < compat.MAX_VERSIONS_JSON_CHARS // 4


@pytest.mark.parametrize("text,fragment", [
    ("", "no versions"),
    ("[]", "JSON object"),
    ("{", "not JSON"),
    ("[" * 100000, "not JSON"),
    (json.dumps({"protocol": "1"}), "protocol"),
    (json.dumps({"protocol": True}), "protocol"),
    (json.dumps({"protocol": -1}), "protocol"),
    (json.dumps({"protocol": 1, "torch": "x" * 65}), "torch"),
    (json.dumps({"protocol": 1, "torch": "2.1; rm -rf"}), "torch"),
    (json.dumps({"protocol": 1, "code": "x"}), "unknown keys"),
    (json.dumps({"protocol": 1, "ops": []}), "ops must be an object"),
    (json.dumps({"protocol": 1, "ops": {"aten::relu": "0" * 16}}), "malformed operator name"),
    (json.dumps({"protocol": 1, "ops": {"aten::relu.default": "0" * 15}}), "malformed"),
    (json.dumps({"protocol": 1, "ops": {"aten::relu.default": 5}}), "malformed"),
    (json.dumps({"protocol": 1, "ops": {f"aten::r{i}.default": "0" * 16 for i in range(compat.MAX_OPS + 1)}}),
     "operators"),
    ("x" * (compat.MAX_VERSIONS_JSON_CHARS + 1), "characters"),
])
def test_what_the_other_side_sends_is_bounded(text, fragment):
    with pytest.raises(compat.VersionsError, match=fragment):
        compat.Versions.from_json(text)
