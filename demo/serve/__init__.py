"""Serving the pipeline through Triton Inference Server (PyTriton): the request schema and its checks (schema), batches
of requests as pipeline calls (batching), the sd-serve command (server) and a client (client).

Only server needs PyTriton and client tritonclient (the `serve` extra); schema and batching import neither.
"""
