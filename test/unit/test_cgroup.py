"""cgroup quota arithmetic, mechanism detection and file writes on fake trees."""

import os

import pytest

from robot_offload.testbed import TestbedError, cgroup


def test_quota_arithmetic():
    # a 20 ms period where the slice cannot be set, 4 ms where it can: a burst shorter
    # than the quota runs at full speed, and the robot would not be slower at every instant
    assert cgroup.DEFAULT_PERIOD_US == 20_000 and cgroup.FINE_PERIOD_US == 4_000
    assert cgroup.period_for_ratio(0.5, cgroup.FINE_PERIOD_US) == 4_000
    assert cgroup.period_for_ratio(0.1, cgroup.FINE_PERIOD_US) == 10_000  # 1 ms quota
    assert cgroup.quota_for_ratio(0.25) == 5_000
    assert cgroup.quota_for_ratio(2.0, 50_000) == 100_000
    # the period grows where the 1 ms minimum quota needs it, up to 1 s
    assert cgroup.period_for_ratio(0.5) == 20_000 and cgroup.period_for_ratio(0.02) == 50_000
    assert cgroup.quota_for_ratio(0.02) == cgroup.MIN_QUOTA_US
    assert cgroup.period_for_ratio(0.0001) == cgroup.MAX_PERIOD_US
    assert cgroup.quota_for_ratio(0.0001) == cgroup.MIN_QUOTA_US  # kernel minimum 1 ms
    assert cgroup.quota_for_ratio(0.001, 100_000) == cgroup.MIN_QUOTA_US
    with pytest.raises(ValueError):
        cgroup.period_for_ratio(0)
    with pytest.raises(ValueError):
        cgroup.quota_for_ratio(0)
    with pytest.raises(ValueError):
        cgroup.quota_for_ratio(0.5, period_us=500)


def test_cpu_max_format_and_parse():
    assert cgroup.format_cpu_max(25_000, 100_000) == "25000 100000"
    assert cgroup.format_cpu_max(None) == "max 20000"
    assert cgroup.parse_cpu_max("max 100000\n") == (None, 100_000)
    assert cgroup.parse_cpu_max("50000 100000") == (50_000, 100_000)
    with pytest.raises(ValueError):
        cgroup.parse_cpu_max("50000")


def test_threads_for_ratio():
    assert cgroup.threads_for_ratio(0.25, ncpu=8) == 1
    assert cgroup.threads_for_ratio(2.6, ncpu=8) == 3
    assert cgroup.threads_for_ratio(20, ncpu=8) == 8


def fake_v1(tmp_path):
    root = tmp_path / "cpu"
    root.mkdir()
    for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us", "cgroup.procs"):
        (root / f).write_text("")
    return root


def fake_v2(tmp_path, controllers="cpu memory", name="v2"):
    root = tmp_path / name
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("\n")
    (root / "cgroup.procs").write_text("")
    return root


def test_choose_mechanism(tmp_path):
    v1 = fake_v1(tmp_path)
    assert cgroup.choose_mechanism(str(v1), ()).kind == "cgroup-v1"
    v2 = fake_v2(tmp_path)
    m = cgroup.choose_mechanism(str(tmp_path / "absent"), (str(v2),))
    assert m == cgroup.Mechanism("cgroup-v2", str(v2))
    nocpu = fake_v2(tmp_path, "memory", name="nocpu")
    m = cgroup.choose_mechanism(str(tmp_path / "absent"), (str(nocpu),))
    assert m.kind == "threads" and "cpu controller" in m.reason and "v1" in m.reason
    assert not cgroup.available(str(tmp_path / "absent"), (str(nocpu),))


def _remove_tree(path):
    for f in os.listdir(path):
        os.unlink(os.path.join(path, f))
    os.rmdir(path)


def test_cpu_limit_v1_writes_quota_and_removes_group(tmp_path):
    v1 = fake_v1(tmp_path)
    mech = cgroup.Mechanism("cgroup-v1", str(v1))
    with cgroup.CpuLimit(0.25, mechanism=mech, remove_dir=_remove_tree,
                         proc_root=str(tmp_path / "noproc"), slice_path=None) as lim:
        assert os.path.basename(lim.path).startswith(f"rotb-{os.getpid()}-")
        assert open(os.path.join(lim.path, "cpu.cfs_quota_us")).read() == "5000"
        assert open(os.path.join(lim.path, "cpu.cfs_period_us")).read() == "20000"
        lim.add(4242)
        assert open(lim.procs_file).read() == "4242"
        assert lim.ratio == pytest.approx(0.25)
        path = lim.path
    assert not os.path.exists(path)
    # the pid left in the group was moved back to the root group
    assert (v1 / "cgroup.procs").read_text() == "4242"


def test_cpu_limit_v2_writes_cpu_max_and_enables_controller(tmp_path):
    v2 = fake_v2(tmp_path)
    mech = cgroup.Mechanism("cgroup-v2", str(v2))
    with cgroup.CpuLimit(quota_us=50_000, period_us=200_000, mechanism=mech,
                         remove_dir=_remove_tree, slice_path=None) as lim:
        assert open(os.path.join(lim.path, "cpu.max")).read() == "50000 200000"
        assert (v2 / "cgroup.subtree_control").read_text() == "+cpu"
        assert lim.ratio == pytest.approx(0.25)
        path = lim.path
    assert not os.path.exists(path)


def _fake_slice(tmp_path, value="5000\n"):
    slice_file = tmp_path / "sched_cfs_bandwidth_slice_us"
    slice_file.write_text(value)
    state = tmp_path / "run"
    state.mkdir()
    return slice_file, state


def test_cpu_limit_sets_a_fine_slice_while_open_and_puts_it_back(tmp_path):
    """Where the bandwidth slice can be written: a 4 ms period, the slice at 1 ms while
    any limit is open, and the value found before back when the last one closes."""
    v1 = fake_v1(tmp_path)
    mech = cgroup.Mechanism("cgroup-v1", str(v1))
    slice_file, state = _fake_slice(tmp_path)
    kw = dict(mechanism=mech, remove_dir=_remove_tree, proc_root=str(tmp_path / "noproc"),
              slice_path=str(slice_file), slice_state_dir=str(state))
    outer = cgroup.CpuLimit(0.5, **kw)
    assert (outer.period_us, outer.quota_us, outer.slice_us) == (4_000, 2_000, 1_000)
    assert slice_file.read_text().strip() == "5000"  # probing wrote the same value back
    with outer:
        assert open(os.path.join(outer.path, "cpu.cfs_period_us")).read() == "4000"
        assert slice_file.read_text() == "1000"
        # the value from before is on record for a crash (testbed cleanup)
        assert (state / f"rotb-{os.getpid()}-0-slice").read_text() == "5000"
        with cgroup.CpuLimit(0.25, **kw) as inner:
            assert inner.quota_us == 1_000
        assert slice_file.read_text() == "1000"  # the outer limit still needs it
    assert slice_file.read_text() == "5000" and os.listdir(state) == []
    outer.close()  # a second close does not release it twice
    assert slice_file.read_text() == "5000"


def test_slice_left_by_a_dead_process_is_put_back_once_no_live_one_holds_it(tmp_path):
    slice_file, state = _fake_slice(tmp_path, "1000")
    dead = 2 ** 22 + 7          # above any pid_max: never alive
    live = os.getppid()
    (state / f"rotb-{dead}-0-slice").write_text("5000")
    (state / f"rotb-{live}-0-slice").write_text("5000")
    (state / "unrelated-slice").write_text("1")
    # another live run still holds it: the dead one's record goes, the slice stays
    assert cgroup.restore_slice(str(slice_file), str(state)) is None
    assert slice_file.read_text() == "1000"
    assert sorted(os.listdir(state)) == [f"rotb-{live}-0-slice", "unrelated-slice"]
    # a limit of this process while that run lives records the value from before it
    v1 = fake_v1(tmp_path)
    with cgroup.CpuLimit(0.5, mechanism=cgroup.Mechanism("cgroup-v1", str(v1)),
                         remove_dir=_remove_tree, proc_root=str(tmp_path / "noproc"),
                         slice_path=str(slice_file), slice_state_dir=str(state)):
        assert (state / f"rotb-{os.getpid()}-0-slice").read_text() == "5000"
    assert slice_file.read_text() == "1000"  # the other run still needs it
    # once nobody lives to hold it (include_live: the other run counts as gone too)
    assert cgroup.restore_slice(str(slice_file), str(state), include_live=True) == 5000
    assert slice_file.read_text() == "5000"
    assert os.listdir(state) == ["unrelated-slice"]


def test_cpu_limit_keeps_a_20ms_period_where_the_slice_cannot_be_set(tmp_path):
    v1 = fake_v1(tmp_path)
    mech = cgroup.Mechanism("cgroup-v1", str(v1))
    for slice_path in (None, str(tmp_path / "missing"), str(tmp_path)):
        lim = cgroup.CpuLimit(0.5, mechanism=mech, slice_path=slice_path)
        assert (lim.period_us, lim.quota_us, lim.slice_us) == (20_000, 10_000, None)
    assert not cgroup.slice_settable(str(tmp_path / "missing"))
    assert cgroup.bandwidth_slice_us(str(tmp_path / "missing")) is None


def test_cpu_limit_refuses_clearly_without_cgroups(tmp_path):
    mech = cgroup.Mechanism("threads", "", "no cpu controller here")
    with pytest.raises(TestbedError, match="no cpu controller here"):
        cgroup.CpuLimit(0.5, mechanism=mech).open()
    with pytest.raises(ValueError):
        cgroup.CpuLimit()
    with pytest.raises(ValueError):
        cgroup.CpuLimit(0.5, quota_us=1000)


def test_own_cgroup_parsing(tmp_path):
    d = tmp_path / "123"
    d.mkdir()
    (d / "cgroup").write_text("12:pids:/a\n4:cpu,cpuacct:/user.slice\n0::/system.slice/x\n")
    assert cgroup._own_cgroup(123, "cgroup-v1", str(tmp_path)) == "/user.slice"
    assert cgroup._own_cgroup(123, "cgroup-v2", str(tmp_path)) == "/system.slice/x"
    assert cgroup._own_cgroup(999, "cgroup-v1", str(tmp_path)) == "/"


def test_quota_cpus_is_the_smallest_quota_on_the_path(tmp_path):
    """v1: a group at 0.5 CPU under a parent at 1.5 reads 0.5; "-1" is no quota. v2: a
    cpu.max of "max" is none, and a parent's 25000/100000 caps a child's unlimited."""
    proc = tmp_path / "proc" / "7"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("4:cpu,cpuacct:/bench/robot\n0::/a/b\n")
    v1 = tmp_path / "v1"
    for d, quota in ((v1, "-1"), (v1 / "bench", "150000"), (v1 / "bench" / "robot", "50000")):
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.cfs_quota_us").write_text(quota)
        (d / "cpu.cfs_period_us").write_text("100000")
    v2 = tmp_path / "v2"
    (v2 / "a" / "b").mkdir(parents=True)
    (v2 / "a" / "b" / "cpu.max").write_text("max 100000")
    none = tmp_path / "none"
    assert cgroup.quota_cpus(7, str(v1), str(none), str(tmp_path / "proc")) == pytest.approx(0.5)
    assert cgroup.quota_limit(7, str(v1), str(none), str(tmp_path / "proc")) == (
        pytest.approx(0.5), 100_000)
    assert cgroup.quota_cpus(7, str(none), str(v2), str(tmp_path / "proc")) is None
    (v2 / "a" / "cpu.max").write_text("5000 20000")
    assert cgroup.quota_cpus(7, str(none), str(v2), str(tmp_path / "proc")) == pytest.approx(0.25)
    assert cgroup.quota_cpus(7, str(v1), str(v2), str(tmp_path / "proc")) == pytest.approx(0.25)
    assert cgroup.quota_limit(7, str(v1), str(v2), str(tmp_path / "proc"))[1] == 20_000
    assert cgroup.quota_cpus(8, str(none), str(none), str(tmp_path / "proc")) is None
