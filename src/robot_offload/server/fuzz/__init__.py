"""Fuzzing the ``ops`` entry of a running offload server with adversarial operator requests.

The ``ops`` entry runs aten operators a client names in JSON (see
:mod:`robot_offload.server.executors.ops.executor` for the request format), so every
request is an untrusted program. This module generates such programs with hypothesis and
drives them against a server, checking what the server promises whatever a client sends:
every request is answered with a status (never an exception, never INTERNAL), the server
process stays up, and a well-behaved client sharing the server keeps getting correct
answers.

How requests are generated (:func:`request_strategy`): operators come from the allow-list
(:func:`allowed_ops`: ``robot_offload.transparent.allowlist`` when it exists, else
:data:`FALLBACK_OPS`); each operator's arguments are drawn from its schema, type by type
(tensors, ints and int lists, floats, scalars, dtypes, devices, strings), each either
plausible (small shapes, tensors the session holds) or adversarial (0, -1, 2**31-1,
2**63-1, lists longer than the wire allows, non-finite floats, wrong types, unknown or
released handles, references of the wrong kind). A request mixes plain ``ops``, ``define``
+ ``replay`` of 1..12 operators with input, constant, output and size-symbol references,
replay continuations, uploads (encoded small tensors, digests, as_strided views of
handles), releases, fetches, unknown keys, other clients' and made-up sessions. What the
server answers (handles, their shapes, sessions, sequences) feeds a :class:`FuzzState`
that later draws refer to, so the fuzz reaches deep into sessions instead of stopping at
the first unknown handle.

:class:`ValidClient` is the well-behaved client: a small two-layer conv net whose output
is known locally, run every few requests both as plain operators and as a replayed
sequence, and compared with ``torch.testing.assert_close``.

Hypothesis is a test and development dependency: it is imported inside the functions that
use it, so importing this module costs nothing on a server. The command line
(``python -m robot_offload.server.fuzz --requests 10000``) starts a roscore and a real
``offload_server`` node (:class:`robot_offload.ros.server_process.RosServer`, imported
only there), runs the fuzz over the ROS ``compute`` service and prints a summary table.
"""
from robot_offload.server.fuzz.report import FuzzReport, ProcessWatch, run_fuzz  # noqa: E402
from robot_offload.server.fuzz.state import FUZZ_CONFIG  # noqa: E402
from robot_offload.server.fuzz.valid_client import ValidClient  # noqa: E402

__all__ = ["FUZZ_CONFIG", "FuzzReport", "ProcessWatch", "ValidClient", "run_fuzz"]
