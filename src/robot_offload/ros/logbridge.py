"""Send the pure layer's ``logging`` records (logger ``robot_offload``) to rosout, so
that what the core logs shows up in rqt_console and in bags like any node message.

:func:`install` also keeps rospy's own logging off the network. On every log call rospy
reads the parameter ``/rosout_disable_topics_generation`` with ``get_param_cached``; when
it is not set, rospy's cache cannot hold "unset" and asks the master again each time, an
XML-RPC call without a timeout. On a link that is slow or down, a single ``logwarn``
then blocks the calling thread for as long as the master is unreachable (measured on the
testbed: 4.7 s of a 5 s outage, in the frame thread, right after a missed deadline).
``install`` subscribes to the parameter once and, when it is unset, caches rospy's own
default (False) locally, so logging never waits for the master.
"""

import logging

import rospy


class RosoutHandler(logging.Handler):
    def emit(self, record):
        msg = self.format(record)
        if record.levelno >= logging.ERROR:
            rospy.logerr(msg)
        elif record.levelno >= logging.WARNING:
            rospy.logwarn(msg)
        elif record.levelno >= logging.INFO:
            rospy.loginfo(msg)
        else:
            rospy.logdebug(msg)


ROSOUT_TOPICS_PARAM = "/rosout_disable_topics_generation"


def cache_rosout_flag():
    """Make rospy's per-log-call parameter lookup local (see the module docstring)."""
    try:
        value = rospy.get_param_cached(ROSOUT_TOPICS_PARAM, None)   # subscribes once
    except Exception:  # noqa: BLE001 - no master yet: rospy will ask again, as before
        return
    if value is None:
        from rospy.impl.paramserver import get_param_server_cache
        get_param_server_cache().set(ROSOUT_TOPICS_PARAM, False)   # rospy's default


def install(level=logging.INFO):
    cache_rosout_flag()
    logger = logging.getLogger("robot_offload")
    if not any(isinstance(h, RosoutHandler) for h in logger.handlers):
        logger.addHandler(RosoutHandler())
    logger.setLevel(level)
    logger.propagate = False
