"""Graph capture, node kinds, cuts on DAGs and the head / tail split (no server)."""

import pytest
import torch
from torch import nn

from robot_offload.models import get_spec
from robot_offload.partition.graph import (INPUT_CUT, OUTPUT_CUT, CutError, capture)

pytestmark = pytest.mark.robot_side


@pytest.fixture(scope="module")
def resnet18():
    spec = get_spec("resnet18")
    model = spec.build()
    graph = capture(model)
    x = spec.example_input((32, 32), seed=3)
    metas, ref = graph.record(x)
    return model, graph, x, metas, ref


def test_resnet18_is_traced_at_layer_granularity(resnet18):
    model, graph, _, metas, _ = resnet18
    assert graph.traced and graph.inputs == ("x",)
    assert graph.kinds["x"] == "input" and graph.kinds["conv1"] == "data"
    assert "layer1_0_conv1" in graph.order and len(graph.order) == 69
    assert metas["conv1"].is_tensor and metas["conv1"].shape == (1, 64, 16, 16)


def test_prefix_cuts_split_exactly(resnet18):
    _, graph, x, metas, ref = resnet18
    cuts = graph.enumerate_cuts(metas)
    assert cuts[0].kind == INPUT_CUT and cuts[0].crossing == ("x",)
    assert cuts[-1].kind == OUTPUT_CUT and not cuts[-1].tail
    assert len({c.crossing for c in cuts}) == len(cuts)
    for i, cut in enumerate(cuts):
        assert not cut.head & cut.tail
        assert cut.head | cut.tail == set(graph.order), cut.label
        # running every split costs two fx code generations each: every residual cut and
        # every third of the others
        if len(cut.crossing) > 1 or i % 3 == 0:
            torch.testing.assert_close(graph.run_split(cut, x, metas), ref, rtol=0, atol=0)


def test_residual_branch_crosses_the_cut(resnet18):
    _, graph, x, metas, ref = resnet18
    # Inside the first block the skip connection (maxpool) is live next to the conv path.
    cut = next(c for c in graph.enumerate_cuts(metas) if c.last == "layer1_0_conv1")
    assert cut.crossing == ("maxpool", "layer1_0_conv1")
    assert cut.label == "after layer1_0_conv1 (2 tensors)"
    assert cut.id == "maxpool,layer1_0_conv1"


def test_a_non_prefix_cut_of_the_dag(resnet18):
    _, graph, x, metas, ref = resnet18
    # Conv path of layer2.0 cut before its BN, the downsample path after its BN: no prefix
    # of the execution order has exactly this frontier.
    cut = graph.cut(["layer2_0_downsample_1", "layer2_0_conv2"])
    assert cut.kind == "inner" and "layer2_0_bn2" in cut.tail and "layer2_0_downsample_1" in cut.head
    assert cut.crossing == ("layer2_0_conv2", "layer2_0_downsample_1")   # execution order
    torch.testing.assert_close(graph.run_split(cut, x, metas), ref, rtol=0, atol=0)
    assert graph.cut(["x"]).kind == INPUT_CUT


@pytest.mark.parametrize("crossing,match", [
    ([], "at least one"),
    (["nonexistent"], "unknown node"),
    ([3], "unknown node"),
    (["conv1", "conv1"], "twice"),
    (["layer1_0_conv1"], "does not separate"),        # the skip path still needs the input
    (["maxpool", "conv1"], "not needed"),               # conv1 is behind maxpool
    (["output"], "only data tensors"),
])
def test_invalid_cuts_are_refused(resnet18, crossing, match):
    _, graph, *_ = resnet18
    with pytest.raises(CutError, match=match):
        graph.cut(crossing)


def test_head_and_tail_share_the_parameters(resnet18):
    model, graph, x, metas, _ = resnet18
    cut = graph.cut(["layer3_0_relu_1"])
    head, tail = graph.head_module(cut), graph.tail_module(cut)
    assert head.get_submodule("conv1") is model.conv1
    assert tail.get_submodule("fc") is model.fc
    assert not hasattr(head, "fc") and graph.head_module(cut) is head   # cached


def test_leaf_modules_are_configurable():
    spec = get_spec("resnet18")
    model = spec.build()
    coarse = capture(model, leaf_modules=["layer1", "layer2", "layer3", "layer4"])
    assert "layer2" in coarse.order and "layer2_0_conv1" not in coarse.order
    x = spec.example_input((32, 32))
    metas, ref = coarse.record(x)
    cuts = coarse.enumerate_cuts(metas)
    assert [c.last for c in cuts if c.kind == "inner"][-6:] == ["layer1", "layer2", "layer3",
                                                                "layer4", "avgpool", "flatten"]
    for cut in cuts:
        torch.testing.assert_close(coarse.run_split(cut, x, metas), ref, rtol=0, atol=0)


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


def test_untraceable_models_fall_back_to_the_two_trivial_cuts():
    graph = capture(_DataDependent())
    assert not graph.traced and "TraceError" in graph.trace_error
    x = torch.ones(1, 4)
    metas, ref = graph.record(x)
    cuts = graph.enumerate_cuts(metas)
    assert [c.kind for c in cuts] == [INPUT_CUT, OUTPUT_CUT]
    torch.testing.assert_close(graph.run_split(cuts[0], x, metas), ref)
    with pytest.raises(CutError, match="cannot trace"):
        capture(_DataDependent(), fallback=False)


def test_shape_reads_come_from_the_record_not_the_wire():
    """FCN reads ``x.shape`` at the input and uses it at the very end (interpolate): the
    shape is a static of the cut, not a crossing tensor."""
    spec = get_spec("fcn_resnet50")
    graph = capture(spec.build())
    x = spec.example_input((32, 32), seed=1)
    metas, ref = graph.record(x)
    assert graph.kinds["getattr_1"] == "shape" and graph.kinds["getitem"] == "const"
    cuts = graph.enumerate_cuts(metas)
    inner = [c for c in cuts if c.kind == "inner"]
    assert len(inner) > 100 and all(c.statics == ("getattr_1",) for c in inner)
    for cut in inner[::40] + inner[-1:]:
        assert all(metas[n].is_tensor for n in cut.crossing)
        torch.testing.assert_close(graph.run_split(cut, x, metas), ref, rtol=0, atol=0)


def test_agrnav_cuts_split_exactly():
    spec = get_spec("agrnav")
    graph = capture(spec.build())
    x = spec.example_input(spec.test_input_size, seed=2)
    metas, ref = graph.record(x)
    cuts = graph.enumerate_cuts(metas)
    # the skips from every scale, and inside the attention its query, keys and values
    assert len(cuts) == 197 and max(len(c.crossing) for c in cuts) == 10
    assert any(c.statics for c in cuts)     # the reshapes and the attention's mask read shapes
    widest = [i for i, c in enumerate(cuts) if len(c.crossing) == 9]
    for i, cut in enumerate(cuts):
        if i in widest[::4] or i % 24 == 0 or (cut.statics and i % 24 == 12):
            torch.testing.assert_close(graph.run_split(cut, x, metas), ref, rtol=0, atol=0)


def test_kapao_decoder_is_one_leaf_node():
    spec = get_spec("kapao_l")
    graph = capture(spec.build())
    detect = next(n for n in graph.order if n.endswith("detect"))
    assert graph.traced and graph.by_name[detect].op == "call_module"
    x = spec.example_input((64, 64), seed=4)
    metas, ref = graph.record(x)
    assert not metas[detect].is_tensor           # (pred, raw): never crosses
    cuts = graph.enumerate_cuts(metas)
    assert all(detect not in c.crossing for c in cuts if c.kind != OUTPUT_CUT)
    heads = [c for c in cuts if c.kind == "inner" and "head_" in c.last]
    last = heads[-1]
    assert len(last.crossing) == 4 and all("head_" in n for n in last.crossing)
    torch.testing.assert_close(graph.run_split(last, x, metas), ref, rtol=0, atol=0)
    neck = next(c for c in cuts if c.last.endswith("out3_cv3_act"))
    torch.testing.assert_close(graph.run_split(neck, x, metas), ref, rtol=0, atol=0)


def test_capture_leaves_other_threads_models_alone_and_traces_take_turns(resnet18):
    """torch.fx patches nn.Module for the whole process while it traces: a model another
    thread runs meanwhile must still compute its tensors (not proxies, not into the
    graph), and two captures at once must both trace."""
    import threading
    model, graph, x, _, ref = resnet18
    n_nodes = len(graph.nodes)
    stop, errors, graphs = threading.Event(), [], []

    def frames():                 # a client's frames, on the model being captured
        try:
            while not stop.is_set():
                with torch.inference_mode():
                    y = model(x)
                torch.testing.assert_close(y, ref)
        except Exception as e:    # noqa: BLE001 - reported below
            errors.append(repr(e)[:300])
            stop.set()

    def captures(n):
        try:
            for _ in range(n):
                graphs.append(capture(model))
        except Exception as e:    # noqa: BLE001
            errors.append(repr(e)[:300])

    runner = threading.Thread(target=frames, daemon=True)
    runner.start()
    tracers = [threading.Thread(target=captures, args=(4,), daemon=True) for _ in range(2)]
    for t in tracers:
        t.start()
    for t in tracers:
        t.join(120)
    stop.set()
    runner.join(30)
    assert not errors, errors
    assert len(graphs) == 8
    assert all(g.traced and len(g.nodes) == n_nodes for g in graphs), \
        [(g.traced, g.trace_error, len(g.nodes)) for g in graphs]
