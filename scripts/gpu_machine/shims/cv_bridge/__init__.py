"""Stand-in for cv_bridge on the GPU machine (its boost-python build is for Debian's 3.11):
8-bit RGB/BGR/mono images only, which is what the bench's frame driver publishes."""
import numpy as np

CHANNELS = {"rgb8": 3, "bgr8": 3, "mono8": 1}


class CvBridgeError(Exception):
    pass


class CvBridge:
    def imgmsg_to_cv2(self, msg, desired_encoding="passthrough"):
        if msg.encoding not in CHANNELS:
            raise CvBridgeError(f"unsupported encoding {msg.encoding!r}")
        ch = CHANNELS[msg.encoding]
        rows = np.frombuffer(msg.data, np.uint8).reshape(msg.height, msg.step)
        img = rows[:, :msg.width * ch].reshape(msg.height, msg.width, ch)
        if ch == 1:
            img = img[:, :, 0]
        if desired_encoding in ("passthrough", msg.encoding):
            return img.copy()
        if {msg.encoding, desired_encoding} == {"rgb8", "bgr8"}:
            return img[..., ::-1].copy()
        raise CvBridgeError(f"cannot convert {msg.encoding} to {desired_encoding}")
