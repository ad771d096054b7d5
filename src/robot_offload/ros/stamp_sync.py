"""Pairing messages of the same camera frame by header stamp (message_filters).

A result (People, InferenceResult) reaches a node up to a deadline after its frame, so
"the latest depth image" or "the latest colour image" belongs to a later frame by then.
:class:`StampPairing` waits for the messages of each input that carry the first input's
stamp (within ``slop_s``), keeping ``queue_size`` of each while it waits, and says in
the log when first-input messages found no partner.
"""

import threading

import message_filters
import rospy


class StampPairing:
    """``callback(first, *others)`` once per set of messages of the same stamp.

    ``subscribers``: message_filters.Subscribers, the first being the one whose every
    message should find partners (the result); its rospy queue should be short and the
    others' as long as ``queue_size``, since a callback runs in the thread of the message
    that completed its set. A first-input message whose partners every other input has
    passed is dropped from the queue when the next one arrives. Every ``check_s`` seconds,
    first-input messages left unpaired (:meth:`unpaired`) are counted and logged with
    ``hint``."""

    def __init__(self, subscribers, queue_size, slop_s, callback, hint, check_s=10.0):
        self._callback = callback
        self._hint = hint
        self._slop = rospy.Duration.from_sec(slop_s)
        self._count_lock = threading.Lock()
        self.received = 0  # first-input messages
        self.paired = 0
        self._reported = 0
        self._newest = [None] * (len(subscribers) - 1)  # newest stamp of each other input
        subscribers[0].registerCallback(self._count)
        for i, sub in enumerate(subscribers[1:]):
            sub.registerCallback(self._seen, i)
        self.sync = message_filters.ApproximateTimeSynchronizer(subscribers, queue_size, slop_s)
        self.sync.registerCallback(self._on_set)
        self._topics = [s.name for s in subscribers]
        self._timer = rospy.Timer(rospy.Duration(check_s), self._check)

    def _count(self, _msg):
        with self._count_lock:
            self.received += 1
        self._prune()

    def _hopeless(self, stamp, newest):
        return all(n is not None and stamp + self._slop < n for n in newest)

    def _prune(self):
        """Drop the queued first-input messages that every other input has passed: their
        partners are gone, and each may be large (a whole result)."""
        with self.sync.lock:
            with self._count_lock:
                newest = list(self._newest)
            queue = self.sync.queues[0]
            for stamp in [s for s in queue if self._hopeless(s, newest)]:
                del queue[stamp]

    def _seen(self, msg, i):
        with self._count_lock:
            if self._newest[i] is None or msg.header.stamp > self._newest[i]:
                self._newest[i] = msg.header.stamp

    def _on_set(self, *msgs):
        with self._count_lock:
            self.paired += 1
        # message_filters calls this holding its lock and releases it only on return:
        # an exception here would stop every later pairing, so it ends here.
        try:
            self._callback(*msgs)
        except Exception as e:  # noqa: BLE001 - one bad frame must not stop the node
            rospy.logerr_throttle(5.0, f"{rospy.get_name()}: frame {msgs[0].header.stamp.to_sec():.3f} "
                                       f"skipped: {type(e).__name__}: {e}")

    def unpaired(self):
        """First-input messages without partners so far: those pushed out of the queue, and
        those still queued that every other input has already passed (newer messages came,
        none of their stamp)."""
        with self.sync.lock:
            waiting = list(self.sync.queues[0])
        with self._count_lock:
            newest = list(self._newest)
            hopeless = sum(1 for s in waiting if self._hopeless(s, newest))
            return max(0, self.received - self.paired - len(waiting) + hopeless)

    def _check(self, _event):
        dropped = self.unpaired()
        if dropped > self._reported:
            rospy.logwarn(f"{rospy.get_name()}: {dropped - self._reported} message(s) of {self._topics[0]} "
                          f"found no {' and '.join(self._topics[1:])} of the same stamp and were dropped "
                          f"({dropped} of {self.received} so far). {self._hint}")
            self._reported = dropped
