"""The star testbed and the fleet's --robot-links without root: addresses, names, the
loopback fallback, the per-robot view TraceReplayer drives, spec parsing and the refusal
to run unshaped."""

import argparse
import time

import pytest

from robot_offload.bench import fleet
from robot_offload.errors import ConfigError
from robot_offload.testbed import StarTestbed, TestbedError, TraceReplayer, star, traces
from robot_offload.testbed._common import owner_pid


def test_addresses_one_slash_30_per_robot_and_the_server_at_the_end():
    server, pairs, plen = star.star_addresses("10.232.0.0/16", 3)
    assert server == "10.232.255.254" and plen == 30
    assert pairs == [("10.232.0.1", "10.232.0.2"), ("10.232.0.5", "10.232.0.6"),
                     ("10.232.0.9", "10.232.0.10")]
    with pytest.raises(ValueError):
        star.star_addresses("10.232.0.0/29", 2)       # 2 links + the server need 12 addresses
    with pytest.raises(ValueError):
        star.star_addresses("10.232.0.0/16", 0)


def test_names_carry_the_owner_pid_and_fit_an_interface_name():
    st = StarTestbed(4)
    assert len(set(st.namespaces)) == 4
    assert all(ns.endswith("-robot") and owner_pid(ns) is not None for ns in st.namespaces)
    assert all(len(n) <= star.IFNAMSIZ for n in st.host_ifs) and len(set(st.host_ifs)) == 4
    assert star.host_label(1234) == "lo:rotb1234"
    with pytest.raises(ValueError):
        StarTestbed(0)


def test_loopback_star_records_rates_and_replays_through_a_link_view():
    with StarTestbed(2, loopback=True) as st:
        assert not st.shaped and st.reason.startswith("loopback, unshaped")
        assert st.server_ip == "127.0.0.1" and st.robot_ip(1) == "127.0.0.1"
        assert st.set_rate(0, 0) == pytest.approx(10_000.0)          # clamped like Testbed
        st.set_rate(1, 5e6, down_bps=20e6)
        assert st.rates[1] == (5e6, 20e6) and st.link(1).down_bps == 20e6
        trace = traces.Trace([1e6, 2e6, 3e6], step_s=0.02, name="t")
        with TraceReplayer(st.link(0), trace) as rp:
            deadline = time.monotonic() + 5
            while not rp.finished and time.monotonic() < deadline:
                time.sleep(0.01)
        assert [r for _, r in rp.applied] == [1e6, 2e6, 3e6] and st.link(0).rate_bps == 3e6
        assert st.rates[1] == (5e6, 20e6)                             # other robot untouched
        proc = st.run(1, ["true"])
        assert proc.wait(10) == 0
        with pytest.raises(ValueError):
            st.set_rate(2, 1e6)
    with pytest.raises(TestbedError):
        st.set_rate(0, 1e6)                                           # closed


def test_robot_link_specs_cycle_and_reject_unknown_names():
    assert fleet.robot_link_specs("indoor, const:20", 3) == ["indoor", "const:20", "indoor"]
    assert fleet.robot_link_specs("const:5,const:50,outdoor", 2) == ["const:5", "const:50"]
    for bad in ("", "wifi", "const:fast"):
        with pytest.raises(ConfigError):
            fleet.robot_link_specs(bad, 2)
    specs = ["const:5", "outdoor"]
    text = fleet.link_text(specs, [traces.from_spec(s, 20.0) for s in specs], 10.0)
    assert "robot0 const:5;" in text and "robot1 outdoor (mean" in text


def _args(**kw):
    ap = argparse.ArgumentParser()
    fleet.add_arguments(ap)
    return ap.parse_args(["--fleet", "2:1", "--server-cpus", "0", *kw.get("extra", [])])


def test_fleet_refuses_robot_links_without_namespaces(monkeypatch, tmp_path):
    started = []

    class NoNamespaces(StarTestbed):
        def open(self):
            raise TestbedError("not root (test)")

    monkeypatch.setattr(fleet, "StarTestbed", NoNamespaces)
    monkeypatch.setattr(fleet, "start_on_free_port", lambda *a: started.append(a))
    args = _args(extra=["--robot-links", "const:5", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        fleet.run(args)
    assert "refusing to run unshaped" in str(e.value) and "not root (test)" in str(e.value)
    assert started == []                                  # nothing started unshaped
    with pytest.raises(SystemExit) as e:
        fleet.run(_args(extra=["--robot-links", "wifi", "--out", str(tmp_path)]))
    assert "unknown trace" in str(e.value)
