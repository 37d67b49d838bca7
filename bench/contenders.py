"""What the benchmark compares: diffusers' modules as they are, the strongest PyTorch peer (channels-last +
torch.compile reduce-overhead), our torch backend at its best and with each toggle off, and TensorRT engines
with and without our plugins, and with an INT8 UNet."""

from __future__ import annotations

from dataclasses import dataclass, replace

from core.errors import UsageError
from demo.backends import TORCH
from demo.backends.torch.options import TorchOptions, TorchSettings
from models.families import FP8
from models.plugin_set import parse_plugin_set
from models.source import VAE_PRECISIONS
from plugins.contract import ATTENTION_KEYS, PLUGIN_KEYS

EAGER = "diffusers-eager"  # the reference every image is compared with
DEFAULTS = "ours-defaults"  # the torch backend's tuned defaults, resolved on the machine that runs it
TRT_AUTO = "tensorrt-auto"  # engines with the plugins `--plugins auto` picks, resolved on the machine that runs it
TRT_INT8 = "tensorrt-int8"  # the same, with the UNet's engine --int8
DIFFUSERS = "diffusers"  # the backend of a contender that runs diffusers' own pipeline (bench.diffusers_pipeline)
CACHED = "@cache"  # <label>@cache<N>: that contender with the step cache every N UNet calls
THRESHOLD = "@thr"  # <label>@thr<T>: that contender with the adaptive step cache at threshold T
# <label>@vae:<V>: that contender with its VAE in precision V (models.source.VAE_PRECISIONS), or another VAE (a --vae
# value: a folder, a file, a built-in such as taesdxl-arch)
OTHER_VAE = "@vae:"
# <label>@fp8: that torch-backend contender with precision fp8 (the UNet's GEMMs in FP8: models.fp8)
AT_FP8 = "@" + FP8
FP8_WHAT = "; the UNet's GEMMs in FP8"


@dataclass(frozen=True)
class Contender:
    label: str
    what: str
    backend: str = "torch"  # a pipeline spec's backend: torch, or tensorrt; or DIFFUSERS (diffusers' pipeline)
    settings: TorchSettings | None = None  # for the torch backend (None: they cannot be resolved here)
    plugins: tuple[str, ...] = ()  # for engines
    int8: bool = False  # engines: the UNet's built with --int8
    # Another contender this one is also compared with, image and UNet output (INT8 against its fp16 engines).
    reference: str | None = None
    skip: str | None = None  # why it cannot run here, found while resolving it (resolve_here)
    # The step cache's interval (`<label>@cache<N>`: the named contender with it); None: the command's --cache-interval
    cache_interval: int | None = None
    # The adaptive step cache's threshold (`<label>@thr<T>`); None: the command's --cache-threshold
    cache_threshold: float | None = None
    vae: str | None = None  # @vae:<V>: another VAE (None: the command's --vae)
    vae_precision: str | None = None  # @vae:<precision>: what its VAE runs in (None: the command's --vae-precision)
    ablates: tuple[str, ...] = ()  # the plugin families this one goes without, beside ours (ours-no-<family>)
    precision: str | None = None  # @fp8: the precision it runs in (None: the command's)

    def spec_fields(self) -> dict:
        """What the contender sets in a pipeline spec (demo.runtime.spec.PipelineSpec) besides the engines' folders:
        its backend, plugins, and for the torch backend exactly its settings; its step cache, VAE and precision where
        its label gives them."""
        # its own cache in place of the command's (either of the two: a spec takes one)
        cache = ({"cache_interval": self.cache_interval, "cache_threshold": 0.0} if self.cache_interval is not None
                 else {"cache_threshold": self.cache_threshold, "cache_interval": 1} if self.own_cache else {})
        cache.update({name: value for name, value in (("vae", self.vae), ("vae_precision", self.vae_precision),
                                                      ("precision", self.precision)) if value is not None})
        if self.settings is None:
            return {"backend": self.backend, "plugins": ",".join(self.plugins) or "none", "use_cuda_graph": True,
                    **cache}
        # diffusers' own pipeline is planned (checked) as the torch backend with its modules' settings
        return {"backend": "torch" if self.backend == DIFFUSERS else self.backend,
                "plugins": ",".join(self.settings.plugins) or "none",
                "use_cuda_graph": self.settings.cuda_graph,
                "torch": TorchOptions(channels_last=self.settings.channels_last, compile=self.settings.compile),
                **cache}

    @property
    def own_cache(self) -> bool:
        """Whether its label gives it its own step cache (@cache<N> or @thr<T>)."""
        return self.cache_interval is not None or self.cache_threshold is not None

    @property
    def uncached_label(self) -> str:
        """The label of the same contender without its own step cache."""
        return self.label.partition(CACHED)[0].partition(THRESHOLD)[0]

    def settings_dict(self) -> dict:
        """The settings a results row records."""
        if self.settings is not None:
            return self.settings.as_dict()
        return {"plugins": list(self.plugins), "cuda_graph": True}


def contenders() -> dict[str, Contender]:
    """Every named contender. DEFAULT_CONTENDERS run unless --contenders says otherwise."""
    every = tuple(sorted(PLUGIN_KEYS))
    ours = TorchSettings(every, channels_last=True, cuda_graph=True, compile="default")
    named = [
        Contender(EAGER, "diffusers' modules as they are (our pipeline, plain torch stages)", settings=TorchSettings()),
        Contender("diffusers-channels-last", "diffusers' modules in channels-last memory",
                  settings=TorchSettings(channels_last=True)),
        Contender("diffusers-compile", "diffusers + channels-last + torch.compile(mode=\"reduce-overhead\")",
                  settings=TorchSettings(channels_last=True, compile="reduce-overhead")),
        Contender("diffusers-pipeline", "diffusers' own pipeline and loop, its modules as they are", DIFFUSERS,
                  settings=TorchSettings()),
        Contender("diffusers-pipeline-compile", "diffusers' own pipeline and loop, denoiser, ControlNets and VAE "
                  "channels-last + torch.compile(mode=\"reduce-overhead\")", DIFFUSERS,
                  settings=TorchSettings(channels_last=True, compile="reduce-overhead"),
                  reference="diffusers-pipeline"),
        Contender("ours", "torch backend: all plugins, channels-last, CUDA graphs, compile default", settings=ours),
        Contender("ours-no-plugins", "ours without plugins", settings=replace(ours, plugins=()), ablates=every),
        Contender("ours-no-channels-last", "ours without channels-last", settings=replace(ours, channels_last=False)),
        Contender("ours-no-cuda-graph", "ours without CUDA graphs", settings=replace(ours, cuda_graph=False)),
        Contender("ours-no-compile", "ours without torch.compile", settings=replace(ours, compile="none")),
        Contender("ours-max-autotune", "ours, compile max-autotune-no-cudagraphs",
                  settings=replace(ours, compile="max-autotune-no-cudagraphs")),
        Contender(DEFAULTS, "torch backend with its tuned defaults for this GPU"),
    ]
    families = {"attention": ATTENTION_KEYS,
                **{key.lower(): (key,) for key in PLUGIN_KEYS if key not in ATTENTION_KEYS}}
    for family, keys in families.items():
        named.append(Contender(f"ours-no-{family}", f"ours without {'/'.join(keys)}",
                               settings=replace(ours, plugins=tuple(k for k in every if k not in keys)), ablates=keys))
    named += [Contender("tensorrt", "TensorRT engines, CUDA graphs", "tensorrt"),
              Contender(TRT_AUTO, "TensorRT engines with the plugins --plugins auto picks here, CUDA graphs",
                        "tensorrt"),
              Contender("tensorrt-plugins", "TensorRT engines with all our plugins, CUDA graphs", "tensorrt",
                        plugins=every),
              Contender(TRT_INT8, "TensorRT engines as tensorrt-auto, the UNet's INT8 (--int8), CUDA graphs",
                        "tensorrt", int8=True,
                        reference=TRT_AUTO)]
    return {c.label: c for c in named}


DEFAULT_CONTENDERS = (EAGER, "diffusers-compile", "ours", "ours-no-plugins", "ours-no-channels-last",
                      "ours-no-cuda-graph", "ours-no-compile", "tensorrt", "tensorrt-plugins")


def select_contenders(text: str | None) -> list[Contender]:
    """--contenders: a comma list of labels, `all`, or `ours+KEY+KEY` (ours with exactly those plugins;
    `ours+none` for none). diffusers-eager always runs first when chosen: every image is compared with it."""
    known = contenders()
    labels = [label.strip() for label in (text or ",".join(DEFAULT_CONTENDERS)).split(",") if label.strip()]
    if labels == ["all"]:
        labels = list(known)
    chosen, unknown = [], []
    for label in labels:
        if label.endswith(AT_FP8):
            found = fp8_contender(label)
            if found is None:
                unknown.append(label)
            else:
                chosen.append(found)
            continue
        named, other_vae, vae = label.partition(OTHER_VAE)
        if other_vae and vae:
            try:
                found = select_contenders(named)[0]
            except UsageError:
                found = None
            if found is None or found.backend == DIFFUSERS:  # diffusers' own pipeline loads its model's VAE
                unknown.append(label)
                continue
            which = {"vae_precision": vae} if vae in VAE_PRECISIONS else {"vae": vae}
            chosen.append(replace(found, label=label, what=f"{found.what}; VAE {vae}", **which))
            continue
        base, cached, interval = label.partition(CACHED)
        thresholded, _, threshold = label.partition(THRESHOLD)
        if cached and base in known and interval.isdigit() and int(interval) >= 2:
            chosen.append(replace(known[base], label=label, cache_interval=int(interval)))
        elif threshold and thresholded in known and positive_number(threshold):
            chosen.append(replace(known[thresholded], label=label, cache_threshold=float(threshold)))
        elif label in known:
            chosen.append(known[label])
        elif label.startswith("ours+") and label != "ours+auto":
            try:
                plugins = parse_plugin_set(label.removeprefix("ours+").replace("+", ","))
            except UsageError:
                unknown.append(label)
                continue
            chosen.append(Contender(label, f"ours with plugins {', '.join(plugins) or 'none'}",
                                    settings=replace(known["ours"].settings, plugins=plugins)))
        else:
            unknown.append(label)
    if unknown or not chosen:
        raise UsageError(f"unknown contender(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(known)}, "
                         f"all, or ours+<plugin>+<plugin>; any of them{CACHED}<N> (N >= 2) with the step cache, "
                         f"{THRESHOLD}<T> (T above 0) with the adaptive one, "
                         f"{OTHER_VAE}<V> with the VAE in precision V ({', '.join(VAE_PRECISIONS)}) or another "
                         f"VAE V (a --vae value), and a torch-backend one{AT_FP8} with the UNet's GEMMs in FP8")
    if len({c.label for c in chosen}) != len(chosen):
        raise UsageError("--contenders names a contender twice")
    return sorted(chosen, key=lambda c: c.label != EAGER)


def fp8_contender(label: str) -> Contender | None:
    """`<label>@fp8`: the torch-backend contender <label> (any form above) in precision fp8; None where <label> is
    unknown or runs elsewhere (engines, diffusers' own pipeline)."""
    try:
        found = select_contenders(label.removesuffix(AT_FP8))[0]
    except UsageError:
        return None
    if found.backend != TORCH or found.precision is not None:
        return None
    return replace(found, label=label, what=found.what + FP8_WHAT, precision=FP8)


def positive_number(text: str) -> bool:
    """Whether `text` is a finite number above 0 (an @thr<T> label's T)."""
    try:
        return 0 < float(text) < float("inf")
    except ValueError:
        return False


def resolve_here(contender: Contender, device, family: str | None = None) -> Contender:
    """ours-defaults with the settings the torch backend takes by default here (unresolved where they cannot
    run); tensorrt-auto with the plugins `--plugins auto` means here; for a family's models (its tuned key);
    any other contender as it is."""
    if contender.precision is not None:  # <label>@fp8: <label> resolved
        base = resolve_here(replace(contender, label=contender.label.removesuffix(AT_FP8), precision=None,
                                    what=contender.what.removesuffix(FP8_WHAT)), device, family)
        return replace(base, label=contender.label, precision=contender.precision, what=base.what + FP8_WHAT)
    if contender.own_cache:
        uncached = resolve_here(replace(contender, label=contender.uncached_label, cache_interval=None,
                                        cache_threshold=None), device, family)
        cache = (f"step cache every {contender.cache_interval}" if contender.cache_interval is not None
                 else f"adaptive step cache at {contender.cache_threshold:g}")
        return replace(uncached, label=contender.label, cache_interval=contender.cache_interval,
                       cache_threshold=contender.cache_threshold, what=f"{uncached.what}; {cache}")
    if contender.label in (TRT_AUTO, TRT_INT8):
        plugins = parse_plugin_set("auto", family=family)
        return replace(contender, plugins=plugins, what=f"{contender.what}: {', '.join(plugins) or 'none'}")
    if contender.label != DEFAULTS:
        return contender
    from demo.backends.torch.settings import resolve_torch_settings  # torch: not needed for --help

    try:
        settings, source = resolve_torch_settings(device=device, family=family)
    except UsageError as exc:
        return replace(contender, what=f"{contender.what}: {exc}", skip=str(exc))
    return replace(contender, settings=settings, what=f"torch backend defaults here: {settings.describe()} ({source})")
