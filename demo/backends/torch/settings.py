"""What the torch backend does to the diffusers modules it runs, and where its defaults come from.

Four settings: two of a pipeline spec's fields both backends take, and the torch backend's own options (TorchOptions):

- `plugins`: our CUDA kernels substituted into the modules (plugins.diffusers_modules);
- `channels_last`: modules and 4-D inputs in channels-last memory;
- `use_cuda_graph`: each stage captured in a CUDA graph once per input shape (while preparing) and
  replayed, from static input buffers, its outputs cloned out;
- `compile`: torch.compile with that mode (none, default, max-autotune-no-cudagraphs,
  reduce-overhead, max-autotune).

Unset, each comes from the "torch_defaults" section of the tuned defaults (plugins/tuned_defaults.json,
read through plugins.tuned), which the benchmark writes with the fastest combination it measured on a GPU
of that compute capability: {"<major>.<minor>": {"plugins": [...], "channels_last": bool, "cuda_graph":
bool, "compile": "...", "gpu": "...", "date": "...", "source": "..."}}. Where it has no entry (or there is
no GPU), FALLBACK: the plain diffusers modules, nothing changed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from core.errors import UsageError, field
from demo.backends.torch.options import COMPILE_MODES, GRAPHING_COMPILE_MODES, TorchOptions, TorchSettings
from models.plugin_set import local_compute_capability, parse_plugin_set
from plugins import torch_ops
from plugins.tuned import TORCH_DEFAULTS, TUNED_DEFAULTS_FILE, find_entry

# The conservative default where the table has no entry: diffusers' modules as they are.
FALLBACK = TorchSettings()


def defaults_entry(compute_capability: str | None, table: Path = TUNED_DEFAULTS_FILE,
                   family: str | None = None) -> tuple[str, dict] | None:
    """The tuned torch defaults for a compute capability ("9.0") and an SDXL (`xl`) or SD 1.x/2.x model from `table`
    (a tuned-defaults file), checked, with the key they were found under; None without any (or without a GPU)."""
    found = find_entry(TORCH_DEFAULTS, compute_capability, family, table) if compute_capability else None
    if found is not None and found[1]["compile"] not in COMPILE_MODES:
        raise UsageError(f"{table}: \"{TORCH_DEFAULTS}\" entry '{found[0]}' needs \"compile\" to be one "
                         f"of {', '.join(COMPILE_MODES)}, not '{found[1]['compile']}'")
    return found


def resolve_torch_settings(plugins: str = "auto", channels_last: bool | None = None, cuda_graph: bool | None = None,
                           compile_mode: str = "auto", device: torch.device | None = None,
                           table: Path = TUNED_DEFAULTS_FILE, family: str | None = None) -> tuple[TorchSettings, str]:
    """Option values (None / "auto": from the tuned defaults in `table` for an SDXL (`xl`) or SD 1.x/2.x model) as
    checked settings, and where they came from.

    `auto` plugins the table names but that cannot run here are left out (a default never fails); asked
    for explicitly, they are a UsageError, as are combinations that cannot work on `device`."""
    device = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    TorchOptions(channels_last, compile_mode).check()
    capability = local_compute_capability() if device.type == "cuda" else None
    key, entry = defaults_entry(capability, table, family) or (None, None)
    base = TorchSettings(tuple(sorted(entry["plugins"])), entry["channels_last"], entry["cuda_graph"],
                         entry["compile"]) if entry else FALLBACK
    source = (f"defaults for compute capability {capability}{' (SDXL)' if key != capability else ''} from "
              f"{table.parent.name}/{table.name} "
              f"({entry.get('gpu', '?')}, {entry.get('date', '?')})" if entry
              else f"no entry for {'compute capability ' + capability if capability else 'a CPU'} in "
                   f"{table.parent.name}/{table.name}: plain diffusers modules")
    chosen_plugins = base.plugins if plugins == "auto" else parse_plugin_set(plugins, family=family)
    if plugins == "auto" and chosen_plugins and not torch_ops.available():
        source += f"; its plugins left out ({torch_ops.status()})"
        chosen_plugins = ()
    # Explicit flags win; a default that would clash with one of them gives way.
    if cuda_graph is None:
        cuda_graph = base.cuda_graph and compile_mode not in GRAPHING_COMPILE_MODES
    if compile_mode == "auto":
        compile_mode = "none" if cuda_graph and base.compile in GRAPHING_COMPILE_MODES else base.compile
    settings = TorchSettings(chosen_plugins, base.channels_last if channels_last is None else channels_last,
                             cuda_graph, compile_mode)
    check_torch_settings(settings, device)
    return settings, source


def check_torch_settings(settings: TorchSettings, device: torch.device) -> None:
    """A UsageError for what cannot run: CUDA-only features on a CPU, plugins that are not built, two CUDA
    graph mechanisms at once."""
    if settings.compile not in COMPILE_MODES:
        raise UsageError(f"unknown {field('compile')} mode '{settings.compile}'; choose one of "
                         f"{', '.join(COMPILE_MODES)}")
    if device.type != "cuda":
        wanted = [what for what, on in ((field("use_cuda_graph"), settings.cuda_graph),
                                        (f"{field('compile')} {settings.compile}", settings.compile != "none"),
                                        (f"{field('plugins')} {','.join(settings.plugins)}", bool(settings.plugins)))
                  if on]
        if wanted:
            raise UsageError(f"{' and '.join(wanted)} need{'s' if len(wanted) == 1 else ''} a CUDA GPU, and the "
                             "torch backend runs on the CPU here")
    if settings.plugins and not torch_ops.available():
        raise UsageError(f"{field('plugins')} {','.join(settings.plugins)}: {torch_ops.status()}")
    if settings.cuda_graph and settings.compile in GRAPHING_COMPILE_MODES:
        raise UsageError(f"{field('compile')} {settings.compile} captures CUDA graphs itself; drop "
                         f"{field('use_cuda_graph')} or use {field('compile')} default or max-autotune-no-cudagraphs")


def computed_part(stage: str, module: torch.nn.Module) -> torch.nn.Module:
    """The part of a stage's module that the stage runs (the VAE stages hold the whole autoencoder)."""
    return {"vae": lambda m: m.vae.decoder, "vae_encoder": lambda m: m.vae.encoder}.get(stage, lambda m: m)(module)


class GraphedCall:
    """`fn(*inputs)` captured once in a CUDA graph over static input buffers, replayed per call.

    Warm-up runs on a side stream first (cuBLAS/cuDNN workspaces, lazy initialisation), as PyTorch's
    CUDA-graph guide asks; the capture runs on that stream too, which is on the inputs' device: torch.cuda.graph's
    own default stream is made once per process, on whichever device was current then, and a capture there of work
    on another GPU fails (sd-serve on cuda:1 after cuda:0, H100 x2, 2026-11-26). Each call copies its inputs into the
    static buffers (clones of `inputs`, in their memory layout), replays, and returns a clone of the outputs, so a
    later replay never changes what an earlier call returned; with `clone_outputs` False, the outputs themselves, for a
    caller that reads them before the next call. `pool`: a memory pool (torch.cuda.graph_pool_handle) shared with
    other graphs that never replay at the same time as this one (a stage's graphs, one per batch size, replay one
    after another on one stream): what one capture freed, a later one may reuse; outputs stay each graph's own, as a
    live tensor's memory is never handed to a later capture. `stream`: the side stream (default: a new one); graphs
    sharing a pool share it too, since the caching allocator hands a freed block only to an allocation on the stream
    that freed it."""

    def __init__(self, fn, inputs: tuple[torch.Tensor, ...], warmup: int = 2, clone_outputs: bool = True,
                 pool=None, stream: torch.cuda.Stream | None = None):
        self.inputs = tuple(t.clone() for t in inputs)
        self.clone_outputs = clone_outputs
        with torch.cuda.device(self.inputs[0].device):
            stream = stream or torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    fn(*self.inputs)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, stream=stream):
                self.output = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor):
        for buffer, value in zip(self.inputs, inputs):
            buffer.copy_(value)
        self.graph.replay()
        if not self.clone_outputs:
            return self.output
        if isinstance(self.output, tuple):
            return tuple(t.clone() for t in self.output)
        return self.output.clone()


def shape_key(inputs: tuple[torch.Tensor, ...]) -> tuple:
    return spec_key((t.shape, t.dtype) for t in inputs)


def spec_key(specs) -> tuple:
    """shape_key of inputs with these (shape, dtype) pairs, without making them."""
    return tuple((tuple(shape), dtype) for shape, dtype in specs)
