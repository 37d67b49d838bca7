"""The toolkit's commands, thin faces on the runtime: their flags (flags.py), turned into a PipelineSpec and a Request
in one place (to_spec.py), run with one-line errors and exit codes (command.py). demo-diffusion (generate),
build-engines, export-onnx, compare-backends, sd-serve (serve), the serve client (client), refit-names; console
scripts in pyproject.toml, thin entry points in demo/ and scripts/ run them from a checkout.

The commands import the runtime (and so torch) when they run, after their flags are parsed: --help and the flags'
own errors answer without it."""
