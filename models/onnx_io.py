"""Saving ONNX models of any size (the one place that knows protobuf's 2 GiB limit)."""

from __future__ import annotations

from pathlib import Path

# Protobuf cannot hold a model above 2 GiB; larger ones keep their weights in one external file.
EXTERNAL_DATA_THRESHOLD = 2**31 - 2**26


def save_onnx(model, path: Path) -> None:
    """Save `model`, moving weights to one external file `<path>.data` when it exceeds 2 GB."""
    import onnx

    if _serialized_size(model) > EXTERNAL_DATA_THRESHOLD:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))


def _serialized_size(model) -> int:
    """The model's protobuf size; protobuf refuses to even measure one above 2 GiB, which is too large."""
    from google.protobuf.message import EncodeError

    try:
        return model.ByteSize()
    except EncodeError:
        return 2**31
