"""Stand-in for the netifaces C extension on the GPU machine (rosgraph needs interfaces()
and ifaddresses()); standard library only: SIOCGIFADDR for IPv4, /proc/net/if_inet6."""
import fcntl
import socket
import struct

AF_INET = socket.AF_INET
AF_INET6 = socket.AF_INET6
SIOCGIFADDR = 0x8915


def interfaces():
    return [name for _, name in socket.if_nameindex()]


def ifaddresses(iface):
    out = {}
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", iface.encode()[:15]))
        out[AF_INET] = [{"addr": socket.inet_ntoa(packed[20:24])}]
    except OSError:
        pass
    finally:
        s.close()
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if parts[-1] == iface:
                    raw = parts[0]
                    addr = ":".join(raw[i:i + 4] for i in range(0, 32, 4))
                    out.setdefault(AF_INET6, []).append(
                        {"addr": socket.inet_ntop(AF_INET6, socket.inet_pton(AF_INET6, addr))})
    except OSError:
        pass
    return out
