"""``/diagnostics`` for a node: a diagnostic_updater Updater publishing, once a second, the
node's own :class:`~robot_offload.health.Report` and the machine's
(:class:`~robot_offload.health.MachineMonitor`).

``/diagnostics`` is global by ROS convention (one aggregator for the whole system); each
status is named ``<node's full name>: <task>``, e.g. ``robot1/offload_client: offload``,
so robots in namespaces stay apart. The hardware id is the host name.
"""

import diagnostic_updater
import rospy
from diagnostic_msgs.msg import DiagnosticStatus

from robot_offload.health import MachineMonitor

PERIOD_S = 1.0


class NodeDiagnostics:
    """Publishes ``name`` (the node's report, from ``report()``) and ``machine``."""

    def __init__(self, name: str, report, period_s: float = PERIOD_S):
        self.machine = MachineMonitor()
        self.updater = diagnostic_updater.Updater()
        self.updater.setHardwareID(self.machine.host)
        self.updater.add(name, self._task(report))
        self.updater.add("machine", self._task(self.machine.report))
        # force_update on a timer of our own: Updater.update() asks the master for
        # ~diagnostic_period four times a second, which blocks while the master is away.
        self._timer = rospy.Timer(rospy.Duration(period_s), lambda _: self.updater.force_update())
        rospy.on_shutdown(self.close)

    @staticmethod
    def _task(report):
        def run(stat):
            try:
                r = report()
            except Exception as e:  # noqa: BLE001 - a failing report must say so, not stop the timer
                stat.summary(DiagnosticStatus.ERROR,
                             f"status unavailable: {type(e).__name__}: {e}")
                return stat
            stat.summary(r.level, r.message)
            for key, value in r.values:
                stat.add(key, value)
            return stat
        return run

    def close(self):
        self._timer.shutdown()
