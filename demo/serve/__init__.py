"""Serving a PipelineSpec through Triton Inference Server (PyTriton): the request schema, parsed into the one request
model with the server's own names in its errors (schema), batches of requests as pipeline calls (batching), one
process per device (workers), the server (server), the Python model Triton runs for it (triton_model: copied into
PyTriton's model store, never imported here) and a client library (client). The commands on them are demo.cli.serve
(sd-serve) and demo.cli.client.

Only server needs PyTriton and client tritonclient (the `serve` extra); schema and batching import neither.
"""
