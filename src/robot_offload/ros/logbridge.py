"""Send the pure layer's ``logging`` records (logger ``robot_offload``) to rosout, so
that what the core logs shows up in rqt_console and in bags like any node message."""

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


def install(level=logging.INFO):
    logger = logging.getLogger("robot_offload")
    if not any(isinstance(h, RosoutHandler) for h in logger.handlers):
        logger.addHandler(RosoutHandler())
    logger.setLevel(level)
    logger.propagate = False
