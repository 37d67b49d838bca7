"""What turns a PipelineSpec into a ready pipeline: the spec (spec.py), the one loader (loader.py), the loaded
pipeline and its results (loaded.py), INT8 calibration's renders (calibrate.py), the memory check (memory.py), the
latency report (report.py) and the libraries' logging (logs.py). The faces (demo.cli, demo.serve, bench, the Python
API in demo/__init__.py) sit on it; it imports none of them."""
