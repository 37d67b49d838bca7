"""A client of sd-serve's models (tritonclient, HTTP or gRPC): a request's fields as the models' inputs, and their image
back. The command that writes the images as PNGs is demo.cli.client (scripts/client.py)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

from demo.request import IMAGE_TO_IMAGE, INPAINTING, TEXT_TO_IMAGE
from demo.serve.schema import BATCH_SIZE, CONTROL_IMAGES, IMAGE, MODEL_NAMES, inputs_of

PROTOCOLS = ("http", "grpc")


class ServeError(Exception):
    """The server answered a request with an error (the message is its one line) or could not be reached. `status`:
    the server's HTTP status ("400") or gRPC code ("StatusCode.INVALID_ARGUMENT"), None where it did not answer."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.status = status


def connect(url: str, protocol: str = "http", concurrency: int = 1):
    """(tritonclient module, client) for `url`; a ServeError where tritonclient is missing."""
    try:
        if protocol == "grpc":
            import tritonclient.grpc as module

            return module, module.InferenceServerClient(url)
        import tritonclient.http as module
    except ImportError:
        raise ServeError("needs tritonclient: pip install -e '.[serve]' (docs/serving.md)") from None
    return module, module.InferenceServerClient(url, concurrency=concurrency, network_timeout=3600.0,
                                                connection_timeout=3600.0)


@contextlib.contextmanager
def connection(url: str, protocol: str = "http") -> Iterator[tuple]:
    """connect()'s (module, client), the client closed on the way out: one a thread, for clients sending at once."""
    module, client = connect(url, protocol)
    try:
        yield module, client
    finally:
        client.close()


def request_inputs(module, values: dict, mode: str) -> list:
    """tritonclient InferInputs for the given request fields (demo.request.Request's names; None: left out) that
    `mode`'s model takes, the batch dimension first: [1, 1] each, an image's array (HxWx3 RGB, a mask HxW) as
    [1, H, W, 3] and [1, H, W]; control_images, one array per ControlNet of the server, as control_image_<i>."""
    inputs = []
    controls = list(values.get(CONTROL_IMAGES) or ())
    for item in inputs_of(mode, len(controls)):
        value = controls.pop(0) if item.field == CONTROL_IMAGES else values.get(item.field)
        if value is None:
            continue
        array = np.array([[value.encode() if isinstance(value, str) else value]] if item.shape == (1,) else [value],
                         dtype=item.dtype)
        tensor = module.InferInput(item.name, list(array.shape), "BYTES" if item.dtype is np.bytes_ else
                                   {np.uint64: "UINT64", np.int32: "INT32", np.float32: "FP32",
                                    np.uint8: "UINT8", np.bool_: "BOOL"}[item.dtype])
        tensor.set_data_from_numpy(array.astype(object) if item.dtype is np.bytes_ else array)
        inputs.append(tensor)
    return inputs


def server_message(exc: Exception) -> str:
    """The first line of the server's answer: sd-serve's errors are one line; Triton's own (a wrong type or shape) may
    run on."""
    text = str(exc.message() if callable(getattr(exc, "message", None)) else exc)
    return (text.strip().splitlines() or [type(exc).__name__])[0]


def mode_of(values: dict) -> str:
    """The mode a request's fields ask for: inpainting with a mask, image-to-image with an input image alone."""
    if values.get("mask") is not None:
        return INPAINTING
    return IMAGE_TO_IMAGE if values.get("image") is not None else TEXT_TO_IMAGE


def generate(module, client, values: dict):
    """(image HxWx3 uint8, the number of requests its pipeline call ran) for one request, from the model its fields
    ask for (mode_of); ServeError with the server's one line and status where it failed."""
    mode = mode_of(values)
    outputs = [module.InferRequestedOutput(name) for name in (IMAGE, BATCH_SIZE)]
    try:
        result = client.infer(MODEL_NAMES[mode], request_inputs(module, values, mode), outputs=outputs)
    except OSError as exc:  # HTTP: nothing listening, the connection dropped
        raise ServeError(f"cannot reach the server: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 -- tritonclient's InferenceServerException: what the server answered
        status = exc.status() if callable(getattr(exc, "status", None)) else None
        raise ServeError(server_message(exc), None if status is None else str(status)) from None
    return result.as_numpy(IMAGE)[0], int(result.as_numpy(BATCH_SIZE).reshape(-1)[0])
