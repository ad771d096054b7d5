"""The well-behaved client: a small conv net run as plain operators and as a replayed
sequence, its answers compared with local torch."""

import json
from typing import Callable, List

import torch

from robot_offload import codec
from robot_offload.protocol import ComputeRequest, ComputeResponse, StatusCode
from robot_offload.server.fuzz.requests import _small_tensor
from robot_offload.server.fuzz.state import VALID_CLIENT

# -- the well-behaved client ---------------------------------------------------------------------
class ValidClient:
    """A client that only sends correct requests: a two-layer conv net (conv 3->8, relu,
    conv 8->4, adaptive average pool, flatten, linear 4->3) on fresh inputs, as plain
    operators and as a defined and replayed sequence, whose answers are compared with the
    same net run locally. ``send(request) -> ComputeResponse``."""

    def __init__(self, send: Callable, client_id: str = VALID_CLIENT, seed: int = 0):
        self.send = send
        self.client_id = client_id
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.randn(8, 3, 3, 3, generator=g) * 0.3
        self.b1 = torch.randn(8, generator=g) * 0.1
        self.w2 = torch.randn(4, 8, 3, 3, generator=g) * 0.3
        self.b2 = torch.randn(4, generator=g) * 0.1
        self.wl = torch.randn(3, 4, generator=g)
        self.bl = torch.randn(3, generator=g)
        self.session = ""
        self.weights: List[int] = []
        self.checks = 0
        self.passed = 0
        self.failures: List[str] = []
        self._seed = seed

    def expected(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(torch.nn.functional.conv2d(x, self.w1, self.b1, 1, 1))
        y = torch.nn.functional.conv2d(y, self.w2, self.b2, 2, 1)
        y = torch.nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)
        return torch.nn.functional.linear(y, self.wl, self.bl)

    def _call(self, args, tensors=()) -> ComputeResponse:
        req = ComputeRequest(client_id=self.client_id, model="", entry="ops", session=self.session,
                             tensors=list(tensors), args_json=json.dumps(args))
        resp = self.send(req)
        if resp.status != StatusCode.OK:
            raise AssertionError(f"valid request refused: {StatusCode(resp.status).name} {resp.status_text}")
        return resp

    def setup(self) -> None:
        """Open a session, upload the weights once and define the net as a sequence."""
        self.session = ""
        ws = [self.w1, self.b1, self.w2, self.b2, self.wl, self.bl]
        resp = self._call({"uploads": [{"n": i} for i in range(len(ws))]},
                          [codec.encode(w, name=f"w{i}") for i, w in enumerate(ws)])
        result = json.loads(resp.result_json)
        self.session = result["session"]
        self.weights = result["uploaded"]
        ops = _net_ops({"i": 0}, lambda i: {"c": self.weights[i]}, lambda j: {"o": [j, 0]})
        self._call({"define": {"id": "net", "n_inputs": 1, "ops": ops}})

    def check(self) -> bool:
        """One checked inference (alternating replay and plain operators); True if correct."""
        self.checks += 1
        x = _small_tensor([1, 3, 8, 8], torch.float32, self._seed * 100003 + self.checks)
        try:
            if not self.session:
                self.setup()
            got = self._replay(x) if self.checks % 2 else self._plain(x)
            torch.testing.assert_close(got, self.expected(x), rtol=1e-4, atol=1e-5)
        except (AssertionError, KeyError, IndexError, ValueError) as e:
            self.failures.append(f"check {self.checks}: {type(e).__name__}: {str(e)[:300]}")
            self.session = ""          # start over with a fresh session next time
            return False
        self.passed += 1
        return True

    def _replay(self, x):
        resp = self._call({"uploads": [{"n": 0}],
                           "replay": {"id": "net", "n": len(NET_OPS), "inputs": [[0, {"u": 0}]],
                                      "fetch": [[len(NET_OPS) - 1, 0]]}},
                          [codec.encode(x, name="x")])
        self._call({"release": json.loads(resp.result_json)["uploaded"]})
        return codec.decode(resp.tensors[0])

    def _plain(self, x):
        """Operator by operator, each naming the previous one's output by its handle."""
        resp = self._call({"uploads": [{"n": 0}]}, [codec.encode(x, name="x")])
        x_h = json.loads(resp.result_json)["uploaded"][0]
        outs: List[int] = []
        for j in range(len(NET_OPS)):
            op = _net_ops({"h": x_h}, lambda i: {"h": self.weights[i]},
                          lambda k: {"h": outs[k] if k < len(outs) else -1})[j]
            resp = self._call({"ops": [op]})
            outs.append(json.loads(resp.result_json)["ops"][0]["t"]["h"])
        resp = self._call({"fetch": [outs[-1]]})
        self._call({"release": [x_h] + outs})      # a request releases before it fetches
        return codec.decode(resp.tensors[0])


NET_OPS = ("aten::convolution.default", "aten::relu.default", "aten::convolution.default",
           "aten::_adaptive_avg_pool2d.default", "aten::flatten.using_ints", "aten::linear.default")


def _net_ops(x, w, prev) -> list:
    """:class:`ValidClient`'s net as ``ops`` operators: ``x`` the input's reference,
    ``w(i)`` weight i's, ``prev(j)`` operator j's output's."""
    def L(*v):
        return {"l": list(v)}

    def T(r):
        return {"t": r}
    args = [
        L(T(x), T(w(0)), T(w(1)), L(1, 1), L(1, 1), L(1, 1), False, L(0, 0), 1),
        L(T(prev(0))),
        L(T(prev(1)), T(w(2)), T(w(3)), L(2, 2), L(1, 1), L(1, 1), False, L(0, 0), 1),
        L(T(prev(2)), L(1, 1)),
        L(T(prev(3)), 1, -1),
        L(T(prev(4)), T(w(4)), T(w(5))),
    ]
    return [{"op": name, "a": a, "k": {}} for name, a in zip(NET_OPS, args)]


