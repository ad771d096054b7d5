"""The ``cancel`` entry: a client takes back one of its own requests that still waits for a
compute slot, named by its ``request_id`` (``{"request_id": "<hex>"}``, no tensors, any
``model``). The answer's ``result_json`` is ``{"state": "cancelled" | "running" |
"unknown"}`` (:meth:`~robot_offload.server.scheduler.FairScheduler.cancel`); the client is
the identity authentication proved, so no client can take back another's request."""

import json

from robot_offload.protocol import ID_RE, ComputeRequest, ComputeResponse, StatusCode
from robot_offload.server.base import Executor, bad_request
from robot_offload.server.executors.partition import json_object


class CancelExecutor(Executor):
    ENTRY = "cancel"
    NEEDS_MODEL = False

    def __call__(self, loaded, req: ComputeRequest) -> ComputeResponse:
        if req.tensors:
            raise bad_request("cancel takes no tensors")
        args = json_object(req.args_json)
        if set(args) != {"request_id"}:
            raise bad_request('cancel takes exactly {"request_id": "<8-64 hex digits>"}')
        request_id = args["request_id"]
        if not isinstance(request_id, str) or not ID_RE.fullmatch(request_id):
            raise bad_request("cancel: request_id must be 8-64 lowercase hex digits")
        state = self.server.scheduler.cancel(str(self.server.identity_of(req)), request_id)
        return ComputeResponse(status=StatusCode.OK, tensors=[], structure_json="null",
                               result_json=json.dumps({"state": state}))
