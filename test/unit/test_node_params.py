"""Nodes read their ``~`` parameters only through ``ros/params.py``: ``load_params`` into
the pure layer's config dataclass (whose field defaults are the only defaults, checked by
its ``validate()``), plus the helpers there (authentication files). A node module that
calls ``rospy.get_param("~x", default)`` itself fails here, unless the read is in
:data:`ALLOWED`; and each ``config/*.yaml`` a launch file loads into a node names only
fields of that node's dataclass."""

import ast
import dataclasses
import xml.etree.ElementTree as ET

import yaml

from test_readme_params import NODE_YAML, ROOT, ROS_DIR, code_params, config_types, node_modules

#: rospy calls that read the parameter server
READS = ("get_param", "get_param_cached", "has_param", "search_param", "get_param_names")

#: (module, "~name") reads a node may make itself, each with its reason
ALLOWED = {
    # the mode switch: read again every frame so `rosparam set` takes effect; its start value
    # and default come from KapaoRepoConfig.mode
    ("kapao_repo_node.py", "~mode"): "run-time",
}


def private_reads(source):
    """``[(line, "~name", default node or None)]`` of the parameter-server reads of
    ``source`` whose name is a ``~`` literal."""
    out = []
    for call in ast.walk(ast.parse(source)):
        if not isinstance(call, ast.Call) or not call.args:
            continue
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        first = call.args[0]
        if (name in READS and isinstance(first, ast.Constant) and isinstance(first.value, str)
                and first.value.startswith("~")):
            out.append((call.lineno, first.value, call.args[1] if len(call.args) > 1 else None))
    return out


def _is_literal(node):
    try:
        ast.literal_eval(node)
        return True
    except ValueError:
        return False


def test_the_check_finds_a_planted_read():
    planted = ("import rospy\nfrom rospy import get_param\n"
               "x = rospy.get_param('~rate_hz', 10.0)\ny = get_param('~a')\n"
               "z = rospy.get_param_cached('~b', None)\nw = rospy.has_param('~c')\n"
               "g = rospy.get_param('/global_name', 1)\nr = rospy.get_param(name)\n")
    assert [(line, name) for line, name, _ in private_reads(planted)] == [
        (3, "~rate_hz"), (4, "~a"), (5, "~b"), (6, "~c")]
    assert _is_literal(private_reads(planted)[0][2])


def test_nodes_read_private_parameters_only_through_params_py():
    found = {}
    for path in sorted(ROS_DIR.glob("*.py")):
        if path.name == "params.py":
            continue
        for line, name, _ in private_reads(path.read_text()):
            if (path.name, name) not in ALLOWED:
                found.setdefault(path.name, []).append(f"{name} (line {line})")
    assert not found, ("read these through load_params (a field of the node's config dataclass): "
                       f"{found}")


def test_allowed_reads_exist_and_run_time_ones_take_the_dataclass_default():
    for (module, name), kind in ALLOWED.items():
        reads = [r for r in private_reads((ROS_DIR / module).read_text()) if r[1] == name]
        assert reads, f"{module} no longer reads {name}: drop it from ALLOWED"
        if kind == "run-time":
            tree = ast.parse((ROS_DIR / module).read_text())
            fields = {f.name for cls in config_types(tree) for f in dataclasses.fields(cls)}
            assert name[1:] in fields, f"{module}: {name} is no field of its config dataclass"
            for line, _, default in reads:
                assert default is not None and not _is_literal(default), (
                    f"{module}:{line}: {name}'s default must be the dataclass field's, not a literal")


def _launch_yaml_loads():
    """``{(launch file, node type): config file name}`` of ``<rosparam command="load">``
    elements inside ``<node>`` elements that load one of ``config/``."""
    out = {}
    for launch in sorted((ROOT / "launch").glob("*.launch")):
        for node in ET.parse(launch).getroot().iter("node"):
            for rp in node.iter("rosparam"):
                file = rp.get("file", "")
                if rp.get("command") == "load" and "/config/" in file:
                    out[(launch.name, node.get("type"))] = file.rsplit("/", 1)[1]
    return out


def test_launch_files_load_the_config_files_of_node_yaml():
    loads = _launch_yaml_loads()
    assert loads, "no launch file loads a config/*.yaml"
    for (launch, node), name in loads.items():
        assert NODE_YAML.get(node) == name, f"{launch}: {node} loads {name}; NODE_YAML says {NODE_YAML.get(node)}"
    assert set(NODE_YAML.items()) == set((node, name) for (_, node), name in loads.items())


def test_config_files_name_only_fields_of_the_nodes_dataclass():
    modules = node_modules()
    for node, name in NODE_YAML.items():
        tree = ast.parse(modules[node].read_text())
        fields = {f.name for cls in config_types(tree) for f in dataclasses.fields(cls)}
        fields |= {n[1:] for (module, n) in ALLOWED if module == modules[node].name}
        keys = set(yaml.safe_load((ROOT / "config" / name).read_text()) or {})
        assert fields, f"{node} loads no config dataclass"
        assert keys <= fields, f"config/{name}: {sorted(keys - fields)} are not fields of {node}'s config"


def test_launch_params_name_parameters_the_node_reads():
    """``<param name=...>`` inside a ``<node>`` names a parameter that node reads."""
    code = code_params()
    wrong = []
    for launch in sorted((ROOT / "launch").glob("*.launch")):
        for node in ET.parse(launch).getroot().iter("node"):
            read = code.get(node.get("type"))
            if read is None:
                continue
            for p in list(node.iter("param")) + [r for r in node.iter("rosparam") if r.get("param")]:
                name = p.get("name") or p.get("param")
                if "~" + name not in read:
                    wrong.append(f"{launch.name}: {node.get('type')} ~{name}")
    assert not wrong, f"parameters set that the node does not read: {wrong}"


def _configs():
    from robot_offload.apps.kapao_repo import KapaoRepoConfig
    from robot_offload.apps.tracking import PersonTrackerNodeConfig
    from robot_offload.bandwidth import BandwidthMonitorConfig
    from robot_offload.camera import CameraConfig
    from robot_offload.client import ClientConfig
    from robot_offload.power import PowerLoggerConfig
    return [  # (config type, fields it needs, (field, bad value) pairs)
        (BandwidthMonitorConfig, {}, [("predictor", "ewma(x)"), ("rate_hz", 0), ("probe_bytes", -1),
                                      ("probe_timeout_s", float("nan")), ("server_ns", "a b")]),
        (CameraConfig, {}, [("width", 0), ("camera_matrix", [1, 2]), ("hfov_deg", 180.0), ("loop", "yes"),
                            ("frame_id", "/camera"), ("rate_hz", True)]),
        (ClientConfig, {}, [("result_codec", "gzip"), ("use_server", "false"), ("publish_outputs", 1),
                            ("server_ns", "")]),
        (KapaoRepoConfig, {"kapao_repo": "/k", "weights": "/k/w.pt"},
         [("kapao_repo", ""), ("mode", "full_offload"), ("imgsz", 0), ("conf_thres", 1.5), ("timeout_s", 0)]),
        (PowerLoggerConfig, {}, [("source", "battery"), ("idle_w", 20.0), ("rate_hz", -1)]),
        (PersonTrackerNodeConfig, {}, [("input", "image"), ("model_input_size", [640]), ("sync_slop_s", 2.0),
                                       ("iou_thres", -0.1)]),
    ]


def test_config_validate_refuses_bad_values_naming_the_parameter():
    from robot_offload.errors import ConfigError
    for cls, needs, bad in _configs():
        good = cls(**needs).validate()
        assert dataclasses.asdict(good).keys() == {f.name for f in dataclasses.fields(cls)}
        for name, value in bad:
            try:
                cls(**dict(needs, **{name: value})).validate()
            except ConfigError as e:
                assert name in str(e), f"{cls.__name__}.{name}={value!r}: {e}"
            else:
                raise AssertionError(f"{cls.__name__}: {name}={value!r} accepted")


def test_validate_keeps_the_defaults():
    for cls, needs, _ in _configs():
        default, checked = cls(**needs), cls(**needs).validate()
        for f in dataclasses.fields(cls):
            if f.name != "client_id":
                assert getattr(checked, f.name) == getattr(default, f.name), f"{cls.__name__}.{f.name}"
