"""One exception family for the whole package.

Server replies carry a :class:`~robot_offload.protocol.StatusCode`; the client turns every
code other than OK back into the matching exception here (tf2's ``TF2Error`` pattern), so a
backend can tell "the link is down, compute locally" from "the request was wrong".
"""


class OffloadError(Exception):
    """Base class of every error raised by robot_offload."""


class ConfigError(OffloadError, ValueError):
    """A parameter or argument has a value that cannot work (unknown mode, bad range)."""


class UnknownModelError(ConfigError):
    """A model name that the registry does not know."""


class CodecError(OffloadError, ValueError):
    """Bytes that do not decode to the tensor they claim to be, or too many of them."""


class TransportError(OffloadError):
    """The server could not be reached or the call broke: retry later, compute locally."""


class OffloadTimeout(TransportError):
    """A server call did not answer within its deadline."""


class ServerUnavailable(TransportError):
    """The server is not there (not started, crashed, connection refused)."""


class RemoteError(OffloadError):
    """The server answered with an error status.

    ``code`` is the :class:`~robot_offload.protocol.StatusCode`; ``text`` is the server's
    explanation.
    """

    def __init__(self, code, text):
        super().__init__(f"{getattr(code, 'name', code)}: {text}")
        self.code = code
        self.text = text


class ModelNotLoaded(RemoteError):
    """The server does not hold the model (it restarted): load it again and retry."""


class HashMismatch(RemoteError):
    """Robot and server hold different weights; offloading would give other results."""


class Unauthorized(RemoteError):
    """The server refused the request's authentication (no, wrong or stale token) or this
    client may not use the model; offloading stays off until the server accepts again."""


class Incompatible(RemoteError):
    """Robot and server would compute differently: another protocol version, or, for the
    operator modes, an operator whose schema differs between their torch versions
    (:mod:`robot_offload.compat`). The message names both sides' versions."""


class StaleHandle(RemoteError):
    """A server-side tensor handle or session the client referred to no longer exists."""
