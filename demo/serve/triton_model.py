"""sd-serve's Triton Python model: never imported by sd-serve itself, but copied into each model of PyTriton's model
store as its model.py (PyTriton's own becomes pytriton_model.py beside it; demo.serve.server.answer_errors_alone), and
run by Triton's Python backend, where only the standard library, numpy and the backend's module are importable.

It is PyTriton's proxy model with one change: a request that sd-serve answered with an error (its `error` and
`error_code` entries, which no model output declares) is answered with Triton's own error of that code, alone in its
batch, its text the one line: HTTP 400 / gRPC INVALID_ARGUMENT for a bad request, 500 / INTERNAL for a failed run, 503
/ UNAVAILABLE while stopping. PyTriton 0.7 itself has no such answer: any exception from the inference function fails
the whole batch as an internal error (HTTP 500) whose text is a traceback naming the server's files.
"""

import triton_python_backend_utils as pb_utils

from . import pytriton_model

ERROR, ERROR_CODE = "error", "error_code"  # demo.serve.schema's
if not hasattr(pytriton_model, "_wrap_response"):  # a PyTriton other than the 0.7.0 the serve extra pins
    raise RuntimeError("sd-serve's model needs PyTriton 0.7.0's proxy model (pip install -e '.[serve]')")
_pytriton_response = pytriton_model._wrap_response


def _response(response, requested_output_names, model_outputs_dict):
    """PyTriton's Triton response for one request's outputs, or the error sd-serve answered it with."""
    data = response.data
    if data is not None and ERROR in data:
        line = bytes(data[ERROR].reshape(-1)[0]).decode("utf-8", "replace")
        if line:
            code = getattr(pb_utils.TritonError, bytes(data[ERROR_CODE].reshape(-1)[0]).decode())
            return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(line, code))
    return _pytriton_response(response, requested_output_names, model_outputs_dict)


pytriton_model._wrap_response = _response  # PyTriton builds every response of a batch through it


class TritonPythonModel(pytriton_model.TritonPythonModel):
    def execute(self, requests):
        """PyTriton's answer; where it fails the batch whole (a traceback), each request gets one line instead, and the
        traceback stays in Triton's log."""
        try:
            return super().execute(requests)
        except pb_utils.TritonModelException as exc:
            pb_utils.Logger.log_error(f"sd-serve: a batch failed in PyTriton: {exc}")
            line = "the server failed this request (its log says why)"
            return [pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(line)) for _ in requests]
