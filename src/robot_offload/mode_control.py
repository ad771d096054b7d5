"""Who may switch an offload client's mode after it started: the pure policy behind the
client node's ``~mode`` parameter and ``~set_mode`` service, no rospy.

Neither interface is authenticated: anyone who reaches the ROS master can set a parameter
or call a service. ``mode_control`` (a client parameter, read once at start) narrows them:

* ``open`` -- both switch the mode (``rosparam set ~mode ...`` takes effect on the next
  frame; ``set_mode`` at once).
* ``service`` -- only ``set_mode`` switches; later changes of the ``~mode`` parameter are
  ignored (logged once). The parameter still shows the mode in force after a ``set_mode``.
  A parameter is written by whoever has the master; a service call can at least be
  restricted and audited per caller by ROS-level measures (SROS, a firewall).
* ``locked`` -- the mode given at start stays; ``set_mode`` is refused with a message and
  parameter changes are ignored (logged once).
"""

import logging
from typing import Optional

MODE_CONTROLS = ("open", "service", "locked")


class ModeControl:
    """Decides, for one client, whether a requested mode switch is allowed. Thread-safe
    enough for its use: the decisions read immutable settings; the once-only log flag may
    at worst log twice."""

    def __init__(self, policy: str, start_mode: str, logger: Optional[logging.Logger] = None):
        if policy not in MODE_CONTROLS:
            raise ValueError(f"unknown mode_control {policy!r}; known: {list(MODE_CONTROLS)}")
        self.policy = policy
        self.start_mode = start_mode
        self.log = logger or logging.getLogger(__name__)
        self._param_ignored_logged = False

    def service_refusal(self, requested: str) -> Optional[str]:
        """None when a ``set_mode`` call may switch to ``requested``, else the text to
        refuse it with."""
        if self.policy == "locked":
            return (f"set_mode refused: mode_control is 'locked', the mode stays "
                    f"{self.start_mode!r} (restart the client with another ~mode to change it)")
        return None

    def mode_from_param(self, wanted, current: str) -> Optional[str]:
        """The mode to switch to because the ``~mode`` parameter now reads ``wanted``, or
        None to keep ``current``. Outside ``open`` a differing value is ignored, and the
        first time that happens it is logged."""
        if wanted == current:
            return None
        if self.policy == "open":
            return str(wanted)
        if not self._param_ignored_logged:
            self._param_ignored_logged = True
            how = ("only the set_mode service switches modes" if self.policy == "service"
                   else f"the mode is fixed at {self.start_mode!r}")
            self.log.warning("~mode parameter changed to %r but ignored: mode_control is %r, %s "
                             "(logged once)", str(wanted)[:64], self.policy, how)
        return None
