"""The commands' faults beyond a bad flag: signals at their last moments and twice over, full disks under the engine
and ONNX folders and the reports, why a cached artifact is built again (said without --verbose), compare-backends
with the step cache, and sd-benchmark's options that a run does not use (each a note)."""

import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests import test_faults
from tests.conftest import ROOT
from tests.test_faults import (
    assert_clean,
    engine_args,
    one_error_line,
    staging_leftovers,
    start,
    truncate,
    wait_for_line,
)

# test_faults' folder with a CLIP ONNX and engine, prepared once here too, and a copy of it per test that damages it
# (built by TensorRT for RTX on the CPU: like test_faults, this needs it).
prepared, work = test_faults.prepared, test_faults.work

DEMO_ARGS = ["a prompt", "--model", "tiny", "--denoising-steps", "1", "--num-warmup-runs", "0", "--seed", "5"]
SAVED = ["tiny-seed5-0.png", "tiny-seed5.json"]


# ---- signals -------------------------------------------------------------------------------------------------------

def one_interrupted_line(err: str) -> bool:
    """The command's stderr ends with its one line for a signal, said once, and holds no traceback (notes before it
    are the run's own)."""
    lines = err.strip().splitlines()
    return lines[-1] == "demo-diffusion: interrupted" and err.count("interrupted") == 1 and "Traceback" not in err

# demo-diffusion as its console command runs it, stopped at the process's very end (its os._exit, after the images
# and the report are saved and every exit function ran) until a line comes on stdin.
PAUSED_AT_EXIT = f"""
import os, sys
sys.path[0] = {str(ROOT)!r}
exit_now = os._exit

def paused(status):
    os._exit = exit_now
    print("[test] paused at exit", file=sys.stderr, flush=True)
    sys.stdin.readline()
    exit_now(status)

os._exit = paused
from demo.cli.entry import demo_diffusion
sys.exit(demo_diffusion())
"""


def test_a_signal_after_the_last_file_is_saved_still_says_interrupted(tmp_path, tiny):
    """Python's own exit tears the interpreter down with the default handlers back (a SIGTERM then killed the
    command without its line): a command ends at its os._exit instead, where the signal is still answered."""
    process = start(["-c", PAUSED_AT_EXIT, *DEMO_ARGS, "--output-dir", tmp_path])
    seen = wait_for_line(process.stderr, "[test] paused at exit")
    try:
        assert "[test] paused at exit" in seen, seen + process.stderr.read()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 143 and one_interrupted_line(seen + err), seen + err
    assert sorted(p.name for p in tmp_path.iterdir()) == SAVED  # saved whole before the signal came
    assert "saved" in out


@pytest.fixture
def handlers_restored():
    """An interrupted command leaves SIGINT and SIGTERM ignored (its process ends on them): put pytest's back."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def test_two_sigints_while_saving_give_one_line_and_a_whole_set(tmp_path, tiny, monkeypatch, capsys,
                                                                handlers_restored):
    """A SIGINT when the first file of the set is linked, another while the staging folder is removed: the set is
    linked whole (the first signal waits for it), the second cuts no cleanup short, one line, status 130."""
    from core import atomic, interrupts
    from demo.cli.generate import main

    def first(path: Path, point: str) -> None:
        if point == "linked" and path.name == SAVED[0]:
            os.kill(os.getpid(), signal.SIGINT)

    remove = shutil.rmtree

    def second(path, *args, **kwargs):
        if ".tmp-" in Path(path).name:
            os.kill(os.getpid(), signal.SIGINT)
        remove(path, *args, **kwargs)

    monkeypatch.setattr(atomic, "checkpoint_hooks", [first])
    monkeypatch.setattr(atomic.shutil, "rmtree", second)
    status = main([*DEMO_ARGS, "--output-dir", str(tmp_path)])
    assert status == 130 and one_interrupted_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == SAVED
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # a third would not kill it without its line
    assert interrupts.received() is None  # what runs in this process next is not taken for interrupted


# ---- full disks: one line, exit 1, nothing left ----------------------------------------------------------------

NO_SPACE = os.strerror(errno.ENOSPC)


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """A 64 KiB tmpfs where mounting works (root on Linux), too small for an engine or an ONNX file and filled with
    `fill()` for smaller ones; elsewhere a folder where every file opened for writing fails with ENOSPC."""
    import builtins
    import io

    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                             capture_output=True).returncode == 0
    if not mounted:
        real = builtins.open

        def open_(file, mode="r", *args, **kwargs):
            if any(m in mode for m in "wx+") and str(Path(os.fspath(file)).absolute()).startswith(str(mount)):
                raise OSError(errno.ENOSPC, NO_SPACE)
            return real(file, mode, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)
    yield mount
    if mounted:
        subprocess.run(["umount", str(mount)], check=True)


def fill(folder: Path) -> None:
    """Take what space is left on `folder`'s disk."""
    try:
        with open(folder / "filler", "wb") as handle:
            while True:
                handle.write(b"\0" * 4096)
                handle.flush()
    except OSError:
        pass


def assert_unlocked(folder: Path) -> None:
    for lock in folder.rglob("*.lock"):
        with open(lock) as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError where a build still held it


def test_a_full_engine_folder_is_one_line(work, full_disk, capsys):
    from demo.cli.build_engines import main

    args = [a if a != str(work / "engine") else str(full_disk / "engine") for a in engine_args(work)]
    status = main(args)
    line = one_error_line(capsys.readouterr().err, "build-engines")
    assert status == 1 and line == f"build-engines: error: cannot build {full_disk}/engine/clip.engine: {NO_SPACE}"
    assert not (full_disk / "engine" / "clip.engine").exists() and staging_leftovers(full_disk) == []
    assert_unlocked(full_disk)
    assert_clean(work)


def test_a_full_onnx_folder_is_one_line(tmp_path, full_disk, capsys):
    from demo.cli.build_engines import main

    args = [a if a != str(tmp_path / "onnx") else str(full_disk / "onnx") for a in engine_args(tmp_path)]
    status = main(args)
    line = one_error_line(capsys.readouterr().err, "build-engines")
    assert status == 1 and line == f"build-engines: error: cannot build {full_disk}/onnx/clip.onnx: {NO_SPACE}"
    assert sorted(p.name for p in (full_disk / "onnx").iterdir()) == ["clip.onnx.lock", "clip.opt.onnx.lock"]
    assert [p.name for p in (tmp_path / "engine").iterdir()] == ["clip.engine.lock"]
    assert_unlocked(full_disk)


def test_a_report_on_a_full_disk_is_one_line(work, full_disk, capsys):
    from demo.cli.build_engines import main

    fill(full_disk)
    report = full_disk / "report.json"
    status = main(engine_args(work, "--report", str(report)))
    line = one_error_line(capsys.readouterr().err, "build-engines")
    assert status == 1 and line == f"build-engines: error: report file '{report}' cannot be written: {NO_SPACE}"
    assert sorted(p.name for p in full_disk.iterdir()) in (["filler"], [])  # [] where no tmpfs could be mounted
    assert_clean(work)


def test_a_controlnets_onnx_export_on_a_full_disk_is_one_line(tmp_path, full_disk, monkeypatch, capsys):
    """demo-diffusion with a ControlNet on (stand-in) TensorRT engines, its ONNX folder full."""
    from PIL import Image

    from demo.cli.generate import main
    from tests import fake_tensorrt

    fake_tensorrt.install(monkeypatch, "10.8.0")
    control = tmp_path / "control.png"
    Image.new("RGB", (64, 64), (200, 20, 20)).save(control)
    status = main([*DEMO_ARGS, "--output-dir", str(tmp_path / "out"), "--backend", "tensorrt", "--plugins", "none",
                   "--controlnet", "tiny-controlnet", "--control-image", str(control), "--onnx-dir",
                   str(full_disk / "onnx"), "--engine-dir", str(tmp_path / "engine"), "--optimization-level", "0"])
    lines = capsys.readouterr().err.strip().splitlines()  # the build's progress, then the one line
    line = lines[-1]
    assert not any("Traceback" in seen for seen in lines), lines
    assert status == 1 and line.startswith(f"demo-diffusion: error: cannot build {full_disk}/onnx/")
    assert line.endswith(f".onnx: {NO_SPACE}")
    assert all(p.name.endswith(".lock") for p in (full_disk / "onnx").iterdir())
    assert_unlocked(full_disk)
    assert not (tmp_path / "out").exists()


# ---- why a cached artifact is built again, without --verbose -------------------------------------------------

def test_a_damaged_engine_or_onnx_says_why_it_is_built_again(work, capsys):
    from demo.cli.build_engines import main

    assert main(engine_args(work)) == 0
    assert "[cache]" not in capsys.readouterr().out  # reused: nothing to say
    truncate(work / "engine" / "clip.engine")
    assert main(engine_args(work)) == 0
    out = capsys.readouterr().out
    assert "[cache] clip.engine: building (clip.engine is truncated or corrupt (1000 bytes, expected " in out
    assert "[cache] clip.opt.onnx" not in out  # verified, and up to date: said with --verbose only

    truncate(work / "onnx" / "clip.opt.onnx")  # said where the engine's build says it (inside which it is made)
    assert main(engine_args(work, "--force-engine-build")) == 0
    out = capsys.readouterr().out
    assert "[cache] clip.opt.onnx: building (clip.opt.onnx is truncated or corrupt (1000 bytes, expected " in out
    assert "[cache] clip.engine" not in out  # forced: the user knows why
    assert_clean(work)


# ---- compare-backends with the step cache ---------------------------------------------------------------------

def test_compare_backends_compares_the_step_cache_paths_of_both(tmp_path, monkeypatch, capsys, tiny):
    from demo.cli.compare_backends import main
    from tests import fake_tensorrt

    fake_tensorrt.install(monkeypatch, "10.8.0")
    results = tmp_path / "compare.json"
    status = main(["--model", "tiny", "--denoising-steps", "3", "--seed", "1", "--cache-interval", "2",
                   "--onnx-dir", str(tmp_path / "onnx"), "--engine-dir", str(tmp_path / "engine"),
                   "--optimization-level", "0", "--json", str(results)])
    out, err = capsys.readouterr()
    assert status == 0, err
    data = json.loads(results.read_text())
    assert (data["cache_interval"], data["cache_branch"]) == (2, 0)
    assert list(data["stages"]) == ["clip", "unet", "unet_shallow", "vae"]
    assert all(row["finite"] and row["max_abs_diff"] < 0.05 * row["reference_max_abs"]
               for row in data["stages"].values()), data["stages"]
    assert data["image"]["max_pixel_diff"] <= 3
    assert "step cache every 2 calls from branch 0 on both" in out.splitlines()[0]


# ---- the adaptive step cache's bad values: one line, exit 2, before any work, in every command that takes them ----

COMMANDS = {  # command -> (its module, the arguments it runs with besides the cache's)
    "demo-diffusion": ("demo.cli.generate", ["a prompt", "--model", "tiny", "--denoising-steps", "1"]),
    "build-engines": ("demo.cli.build_engines", ["--model", "tiny", "--stages", "unet"]),
    "compare-backends": ("demo.cli.compare_backends", ["--model", "tiny", "--denoising-steps", "1"]),
    "sd-quality": ("bench.quality", ["--model", "tiny"]),
    "sd-serve": ("demo.cli.serve", ["--model", "tiny"]),
}
BAD_THRESHOLDS = [
    (["--cache-threshold", "-0.1"], "--cache-threshold must be a finite number at least 0, got -0.1"),
    (["--cache-threshold", "nan"], "--cache-threshold must be a finite number at least 0, got nan"),
    (["--cache-threshold", "abc"], "argument --cache-threshold: invalid float value: 'abc'"),
    (["--cache-threshold", "0.1", "--cache-interval", "3"],
     "--cache-threshold and --cache-interval are two step caches"),
    (["--cache-threshold", "0.1", "--cache-max-skips", "0"], "--cache-max-skips must be at least 1, got 0"),
]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("args, message", BAD_THRESHOLDS, ids=[" ".join(a) for a, _ in BAD_THRESHOLDS])
def test_a_bad_cache_threshold_is_one_line_and_exit_2(command, args, message, tmp_path, monkeypatch, capsys, tiny):
    import importlib

    module, given = COMMANDS[command]
    monkeypatch.chdir(tmp_path)  # nothing written where the test runs
    assert importlib.import_module(module).main([*given, *args]) == 2
    assert message in one_error_line(capsys.readouterr().err, command)
    assert list(tmp_path.iterdir()) == []


# ---- sd-benchmark: an option the run does not use is a note -----------------------------------------------------

UNUSED = [
    (["--contenders", "ours", "--optimization-level", "2"], "--optimization-level unused: no TensorRT contender runs"),
    (["--contenders", "ours", "--engines-from-ablation", "{tmp}"],
     "--engines-from-ablation unused: no TensorRT contender runs"),
    (["--contenders", "tensorrt", "--engines-from-ablation", "{tmp}", "--engine-dir", "x", "--optimization-level",
      "2"], "--engine-dir unused with --engines-from-ablation: its engines run as they are, nothing is built"),
    (["--contenders", "tensorrt", "--calibration-steps", "3"],
     "--calibration-steps unused without an INT8 contender (tensorrt-int8)"),
    (["--contenders", "ours@cache2,tensorrt@cache3", "--cache-interval", "4"],
     "--cache-interval unused: every contender has its own (@cache<N> or @thr<T>)"),
    (["--contenders", "ours@thr0.1,tensorrt@cache3", "--cache-threshold", "0.2"],
     "--cache-threshold unused: every contender has its own (@cache<N> or @thr<T>)"),
    (["--contenders", "ours", "--cache-branch", "1"],
     "--cache-branch unused without the step cache (--cache-interval 1, and no contender@cache<N> or @thr<T>)"),
    (["--contenders", "ours", "--defaults-file", "x.json"], "--defaults-file unused without --update-defaults"),
    (["--contenders", "tensorrt", "--optimization-level", "2"], None),
    (["--contenders", "tensorrt-int8", "--calibration-steps", "3"], None),
    (["--contenders", "ours@cache2", "--cache-branch", "1"], None),
    (["--contenders", "ours@thr0.05", "--cache-branch", "1"], None),
    (["--contenders", "ours,ours@cache2", "--cache-interval", "3"], None),
    (["--contenders", "ours", "--update-defaults", "--defaults-file", "x.json"], None),
]


@pytest.mark.parametrize("args, note", UNUSED, ids=[" ".join(a) for a, _ in UNUSED])
def test_sd_benchmark_notes_each_option_no_contender_uses(args, note, tmp_path, monkeypatch, capsys):
    from bench import benchmark

    monkeypatch.setattr(benchmark, "benchmark", lambda flags, chosen: 0)  # the notes come before any work
    monkeypatch.chdir(tmp_path)
    assert benchmark.main([a.format(tmp=tmp_path) for a in args]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert notes == ([f"[sd-benchmark] note: {note}"] if note else [])


def test_sd_benchmark_notes_what_the_request_does_not_use(tmp_path, monkeypatch, capsys, tiny):
    from bench import benchmark

    monkeypatch.setattr(benchmark, "measure", lambda *_: None)
    monkeypatch.chdir(tmp_path)
    assert benchmark.main(["--model", "tiny", "--contenders", "ours", "--guidance-scale", "1", "--negative-prompt",
                           "blurry", "--denoising-steps", "1"]) == 0
    assert ("[sd-benchmark] note: --negative-prompt unused at --guidance-scale 1.0: there is no classifier-free "
            "guidance at 1 or below") in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("label, fields, lacking", [
    ("tensorrt-int8", {}, "INT8"),
    ("tensorrt", {"controlnets": (("tiny-controlnet", 1.0),)}, "ControlNet"),
    ("tensorrt", {"cache_interval": 2}, "step cache"),
    ("tensorrt@cache2", {}, "step cache"),
])
def test_sd_ablations_engines_are_not_run_for_what_they_lack(label, fields, lacking, tmp_path, tiny):
    """--engines-from-ablation runs the ablation's plain engines: a TensorRT contender that asks for more is
    skipped, saying so, never run on them as if it had it."""
    from bench.contenders import select_contenders
    from bench.runner import Setup, why_skip
    from demo.runtime.spec import PipelineSpec

    setup = Setup(PipelineSpec(model="tiny", **fields), tiny, None, None, None, None, 1, 0,
                  engines_from_ablation=str(tmp_path))
    [contender] = select_contenders(label)
    assert why_skip(setup, contender, None, None) == (f"sd-ablation builds no {lacking} engines "
                                                      "(--engines-from-ablation runs its engines)")
