"""Power sources parse fixture sysfs trees; the state model and EnergyMeter integrate right."""

import os
import shutil

import pytest

from robot_offload import power

pytestmark = pytest.mark.robot_side

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "power")


class FakeClock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def test_jetpack4_rails_and_input_rail_total():
    src = power.JetsonIna3221Source(os.path.join(FIXTURES, "jetpack4"), clock=FakeClock(5.0))
    r = src.read()
    assert src.layout == "jetpack4"
    assert r.rails == pytest.approx({"POM_5V_IN": 4.520, "POM_5V_GPU": 1.240,
                                     "POM_5V_CPU": 1.876})
    assert r.watts == pytest.approx(4.520)  # the input rail alone, not the sum
    assert r.t_s == 5.0 and r.source == "jetson-ina3221" and not r.modelled
    assert "POM_5V_IN" in src.describe()


def test_jetpack5_rails_volts_times_amps():
    src = power.JetsonIna3221Source(os.path.join(FIXTURES, "jetpack5"))
    r = src.read()
    assert src.layout == "jetpack5"
    assert r.rails == pytest.approx({"VDD_IN": 5.048 * 1.520,
                                     "VDD_CPU_GPU_CV": 5.040 * 0.480,
                                     "VDD_SOC": 5.040 * 0.520})
    assert r.watts == pytest.approx(7.67296)
    assert "sum of shunt voltages" not in r.rails


def test_jetson_without_input_rail_sums_all(tmp_path):
    dev = tmp_path / "sys/bus/i2c/drivers/ina3221x/1-0040/iio:device0"
    dev.mkdir(parents=True)
    for ch, (name, mw) in enumerate([("GPU", 3000), ("CPU", 2000), ("NC", 999)]):
        (dev / f"rail_name_{ch}").write_text(name + "\n")
        (dev / f"in_power{ch}_input").write_text(f"{mw}\n")
    src = power.JetsonIna3221Source(str(tmp_path))
    r = src.read()
    assert r.rails == pytest.approx({"GPU": 3.0, "CPU": 2.0})  # NC skipped
    assert r.watts == pytest.approx(5.0)


def test_rapl_power_from_energy_and_wraparound(tmp_path):
    root = tmp_path / "rapl"
    shutil.copytree(os.path.join(FIXTURES, "rapl"), root)
    clock = FakeClock(100.0)
    src = power.RaplSource(str(root), clock=clock, sleep=lambda s: None)
    assert src.total_domains == ["package-0", "package-1"]
    pc = root / "sys/class/powercap"
    # 2 s later: package-0 +30 J -> 15 W; package-1 wraps: 328850 uJ to the top, then
    # 9671150 uJ after it: 10 J -> 5 W. The core sub-domain is not counted.
    (pc / "intel-rapl:0/energy_uj").write_text("31000000\n")
    (pc / "intel-rapl:1/energy_uj").write_text("9671150\n")
    (pc / "intel-rapl:0:0/energy_uj").write_text("99999999999\n")
    clock.t = 102.0
    r = src.read()
    assert r.rails == pytest.approx({"package-0": 15.0, "package-1": 5.0})
    assert r.watts == pytest.approx(20.0)
    assert r.source == "rapl" and not r.modelled and r.t_s == 102.0
    assert power.RaplSource.energy_delta_uj(10, 5, 100) == 95


def test_rapl_psys_alone_is_the_total(tmp_path):
    root = tmp_path / "rapl"
    shutil.copytree(os.path.join(FIXTURES, "rapl"), root)
    psys = root / "sys/class/powercap/intel-rapl:2"
    psys.mkdir()
    (psys / "name").write_text("psys\n")
    (psys / "energy_uj").write_text("0\n")
    clock = FakeClock(0.0)
    src = power.RaplSource(str(root), clock=clock)
    (psys / "energy_uj").write_text("50000000\n")
    clock.t = 1.0
    assert src.read().watts == pytest.approx(50.0)


def test_detect_source_order(tmp_path):
    assert power.detect_source(os.path.join(FIXTURES, "jetpack5")).name == "jetson-ina3221"
    assert power.detect_source(os.path.join(FIXTURES, "rapl")).name == "rapl"
    model = power.detect_source(str(tmp_path))
    assert model.name == "model" and model.read().modelled
    with pytest.raises(power.PowerSourceUnavailable):
        power.JetsonIna3221Source(str(tmp_path))
    with pytest.raises(power.PowerSourceUnavailable):
        power.RaplSource(str(tmp_path))


def test_state_model_powers_and_overlap_rule():
    m = power.StateModelSource()
    assert m.power_of("idle") == pytest.approx(4.04)
    assert m.power_of("compute") == pytest.approx(13.35)
    assert m.power_of("transmit") == pytest.approx(4.25)
    # idle floor once, the radio's 0.21 W on top of computing
    assert m.power_of("compute+transmit") == pytest.approx(13.56)
    assert m.power_of(["transmit", "compute"]) == pytest.approx(13.56)
    with pytest.raises(ValueError):
        m.power_of("sleep")


def test_state_model_energy_is_exact():
    clock = FakeClock(0.0)
    m = power.StateModelSource(clock=clock)
    m.set_state("compute", 1.0)
    m.set_state("compute+transmit", 1.5)
    m.set_state("transmit", 2.0)
    m.set_state("idle", 3.0)
    # [0,1) idle 4.04, [1,1.5) 13.35, [1.5,2) 13.56, [2,3) 4.25, [3,4) idle
    expected = 4.04 + 0.5 * 13.35 + 0.5 * 13.56 + 4.25 + 4.04
    assert m.energy_between(0.0, 4.0) == pytest.approx(expected)
    assert m.energy_between(1.25, 1.75) == pytest.approx(0.25 * 13.35 + 0.25 * 13.56)
    assert m.energy_between(2.5, 2.5) == 0.0
    assert m.time_in_states(0.0, 4.0) == pytest.approx(
        {"idle": 2.0, "compute": 0.5, "compute+transmit": 0.5, "transmit": 1.0})
    clock.t = 2.5
    r = m.read()
    assert r.watts == pytest.approx(4.25) and r.modelled and r.source == "model"
    assert sum(r.rails.values()) == pytest.approx(r.watts)
    with pytest.raises(ValueError):
        m.set_state("compute", 2.9)  # before the last change


def test_state_model_begin_end_counts_overlaps():
    clock = FakeClock(0.0)
    m = power.StateModelSource(clock=clock)
    m.begin("transmit", 0.0)
    m.begin("transmit", 0.5)   # a second concurrent transfer
    m.end("transmit", 1.0)     # one still running
    assert m.state_at(1.2) == "transmit"
    clock.t = 1.5
    with m.activity("compute"):
        assert m.state_at(1.5) == "compute+transmit"
        clock.t = 2.0
    m.end("transmit", 2.0)
    assert m.state_at(2.0) == "idle"
    assert m.energy_between(0.0, 2.0) == pytest.approx(1.5 * 4.25 + 0.5 * 13.56)
    with pytest.raises(ValueError):
        m.end("compute", 3.0)


def test_state_model_bounded_history():
    m = power.StateModelSource(max_changes=4)
    for i in range(10):
        m.set_state("compute" if i % 2 else "idle", float(i))
    assert m.history_start_s == 6.0
    assert m.energy_between(6.0, 8.0) == pytest.approx(4.04 + 13.35)
    with pytest.raises(ValueError):
        m.energy_between(0.0, 8.0)


class ScriptedSource(power.PowerSource):
    name = "scripted"

    def __init__(self, points):
        self._points = list(points)

    def read(self):
        t, w = self._points.pop(0)
        return power.PowerReading(t, w, {}, self.name, False)


def test_energy_meter_trapezoid_and_interpolation():
    meter = power.EnergyMeter(ScriptedSource([(0.0, 10.0), (1.0, 20.0), (3.0, 20.0)]))
    for _ in range(3):
        meter.sample()
    # [0,1]: (10+20)/2 = 15 J; [1,3]: 40 J
    assert meter.energy_between(0.0, 3.0) == pytest.approx(55.0)
    # [0.5, 2]: w(0.5) = 15 -> (15+20)/2*0.5 = 8.75, + 20 = 28.75
    assert meter.energy_between(0.5, 2.0) == pytest.approx(28.75)
    assert meter.mean_power_w(1.0, 3.0) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="not covered"):
        meter.energy_between(0.0, 4.0)


def test_energy_meter_on_the_model_matches_exact_energy():
    clock = FakeClock(0.0)
    m = power.StateModelSource(clock=clock)
    meter = power.EnergyMeter(m)
    m.set_state("compute", 0.0)
    m.set_state("idle", 1.0)
    for i in range(21):  # samples every 0.1 s; one ramp segment at the edge
        clock.t = 0.1 * i
        meter.sample()
    exact = m.energy_between(0.0, 2.0)
    assert meter.energy_between(0.0, 2.0) == pytest.approx(exact, abs=0.1 * (13.35 - 4.04))


def test_energy_meter_background_thread():
    m = power.StateModelSource(compute_w=10.0, transmit_w=5.0, idle_w=5.0)
    with power.EnergyMeter(m) as meter:
        meter.start(0.01)  # already running: no second thread
        import time
        time.sleep(0.05)
    t0, t1 = meter.span_s
    assert t1 > t0
    assert meter.energy_between(t0, t1) == pytest.approx(5.0 * (t1 - t0))
