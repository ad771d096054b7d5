"""How much of what a TCP socket sent its peer has acknowledged, and how much it has
received, from the kernel.

``TCP_INFO``'s ``tcpi_bytes_acked`` and ``tcpi_bytes_received`` (Linux 4.2 and later, so
every Jetson L4T and the Debian 12 server) count the bytes the peer has acknowledged, and
the bytes that arrived, on the connection since it opened. Read before and during a call
they say how far its upload, then its answer, has got: the rate the link is giving this
very transfer, which a robot can act on before the answer is whole
(:mod:`robot_offload.local_hedge`).
"""

import socket
import struct
from typing import Optional

#: offset of ``tcpi_bytes_acked`` (u64) in ``struct tcp_info`` (include/uapi/linux/tcp.h):
#: 8 one-byte fields, 24 u32 fields, ``tcpi_pacing_rate`` and ``tcpi_max_pacing_rate``
BYTES_ACKED_OFFSET = 120
#: offset of ``tcpi_bytes_received`` (u64), right after it
BYTES_RECEIVED_OFFSET = 128
_INFO_LEN = 256


def bytes_acked(sock) -> Optional[int]:
    """Bytes the peer of the TCP socket ``sock`` has acknowledged since it connected, or
    None where the kernel does not say (another OS, an older kernel, a closed socket, no
    socket at all)."""
    return _info_u64(sock, BYTES_ACKED_OFFSET)


def bytes_received(sock) -> Optional[int]:
    """Bytes of data the TCP socket ``sock`` has received since it connected (whether or
    not they were read yet), or None where the kernel does not say."""
    return _info_u64(sock, BYTES_RECEIVED_OFFSET)


def _info_u64(sock, offset: int) -> Optional[int]:
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_LEN)
    except (OSError, ValueError):
        return None
    if len(info) < offset + 8:
        return None
    return struct.unpack_from("=Q", info, offset)[0]


def abort(sock) -> None:
    """Make closing the TCP socket ``sock`` drop what it has not sent yet (a reset, not the
    orderly close that would go on sending it in the background): ``SO_LINGER`` on, with
    a timeout of 0. Errors are ignored (the socket may be closed already)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except (OSError, AttributeError):
        pass
