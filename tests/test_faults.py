"""Every fault a user can cause is answered: a one-line error (exit status 2) or a clean rebuild,
and nothing half-written is left (no staging folders, no empty output folders, artifacts whose files match
their manifests).

Kill and race tests run real processes stopped at a known point inside a build (tests/paused.py hooks
core.artifacts' checkpoints: the process says where it stopped, then waits for a line on stdin), never a sleep
that races.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx-cu13 is not installed")

from tests.conftest import ROOT  # noqa: E402

BUILD_ENGINES = ROOT / "scripts" / "build_engines.py"
# Small and fast: the CLIP stage of `tiny`, built on the CPU by TensorRT for RTX.
ENGINE_ARGS = ["--model", "tiny", "--backend", "tensorrt-rtx", "--target-cc", "8.6", "--optimization-level", "0",
               "--stages", "clip", "--onnx-precision", "fp32"]


# ---- what "nothing half-written" means -----------------------------------------------------------------

def staging_leftovers(root: Path) -> list[Path]:
    """Staging folders and temporary files of the artifact cache and of atomic writes, anywhere under root."""
    return sorted(p for p in root.rglob(".*") if ".build-" in p.name or ".tmp-" in p.name)


def assert_artifacts_intact(folder: Path) -> None:
    """Every artifact with a manifest has exactly the files it records (size and SHA-256)."""
    for lock in folder.glob("*.lock"):
        manifest = lock.with_suffix(".json")
        if not manifest.exists():
            continue
        for name, recorded in json.loads(manifest.read_text())["files"].items():
            data = (folder / name).read_bytes()
            assert len(data) == recorded["size"] and hashlib.sha256(data).hexdigest() == recorded["sha256"], name


def assert_clean(root: Path) -> None:
    assert staging_leftovers(root) == []
    for folder in {lock.parent for lock in root.rglob("*.lock")}:
        assert_artifacts_intact(folder)


def engine_args(root: Path, *extra: str) -> list[str]:
    return [*ENGINE_ARGS, "--onnx-dir", str(root / "onnx"), "--engine-dir", str(root / "engine"), *extra]


def one_error_line(err: str, prog: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


# ---- a prepared folder (fp32 CLIP ONNX and engine), copied by each test that damages it ------------

@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny):
    from demo.cli.build_engines import main

    root = tmp_path_factory.mktemp("prepared")
    assert main(engine_args(root)) == 0
    return root


@pytest.fixture
def work(prepared, tmp_path):
    root = tmp_path / "work"
    shutil.copytree(prepared, root)
    return root


def build_in_process(root: Path, capsys, *extra: str) -> str:
    """build_engines in this process (--verbose: cache decisions on stdout); returns stdout."""
    from demo.cli.build_engines import main

    status = main(engine_args(root, "--verbose", *extra))
    out, err = capsys.readouterr()
    assert status == 0, err
    return out


# ---- usage errors: one line, exit status 2, nothing created ---------------------------------------------

@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return path


DEMO_ERRORS = [
    (["--seed", str(2**64)], f"--seed must be 0..{2**64 - 1}, got {2**64}"),
    (["--seed", "-1"], f"--seed must be 0..{2**64 - 1}, got -1"),
    (["--scheduler", "Bogus"], "--scheduler 'Bogus' is unknown"),
    (["--denoising-steps", "2147483647", "--scheduler", "ddim"],  # refused at once: no schedule that long is built
     "--denoising-steps 2147483647 is more than scheduler DDIM can take for this model: at most 1000"),
    (["--guidance-scale", "nan"], "--guidance-scale must be a finite number, 0 or more, got nan"),
    (["--guidance-scale", "inf"], "--guidance-scale must be a finite number"),
    (["--num-warmup-runs", "-1"], "--num-warmup-runs must be 0 or more"),
    (["--denoising-steps", "0"], "--denoising-steps must be at least 1"),
    (["--denoising-steps", "100000", "--scheduler", "PNDM"],
     "--denoising-steps 100000 is more than scheduler PNDM can take for this model: at most 1000"),
    (["--denoising-steps", "1000", "--scheduler", "DPM++2M"],  # it would run all 1000 steps at t=1
     "--denoising-steps 1000 is more than scheduler DPM++2M can take for this model: at most 999"),
    (["--height", "60"], "--height must be a multiple of 8"),
    (["--backend", "onnx"], "unknown backend 'onnx'"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--output-dir", "{file}/sub"], "output directory '{file}/sub' cannot be written: '{file}' is not a directory"),
    (["--output-dir", "{file}"], "output directory '{file}' cannot be written: '{file}' is not a directory"),
]


@pytest.mark.parametrize("args, message", DEMO_ERRORS, ids=[" ".join(a) for a, _ in DEMO_ERRORS])
def test_demo_usage_errors_create_nothing(args, message, tmp_path, a_file, tiny, capsys, no_loading):
    from demo.cli.generate import main

    out = tmp_path / "out"
    args = [a.format(file=a_file) for a in args]
    status = main(["a prompt", "--output-dir", str(out), "--denoising-steps", "2", *args])
    line = one_error_line(capsys.readouterr().err, "demo-diffusion")
    assert status == 2 and message.format(file=a_file) in line
    assert not out.exists()  # not even an empty output folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


BUILD_ERRORS = [
    (["--onnx-dir", "{file}/x"], "ONNX directory '{file}/x' cannot be written: '{file}' is not a directory"),
    (["--engine-dir", "{file}/x"], "engine directory '{file}/x' cannot be written: '{file}' is not a directory"),
    (["--timing-cache", "{file}/x"], "timing cache '{file}/x' cannot be written: '{file}' is not a directory"),
    (["--timing-cache", "{tmp}"], "timing cache '{tmp}' cannot be written: it is not a regular file"),
    (["--report", "{file}/x.json"], "report file '{file}/x.json' cannot be written: '{file}' is not a directory"),
    (["--optimization-level", "9"], "--optimization-level must be 0..5, got 9"),
    (["--disable-tactic-sources", "CUBLAS,FOO"], "has no tactic source CUBLAS, FOO (it has: "),
    (["--stages", "clip,text"], "unknown stage(s) text"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--height", "60"], "--height must be a multiple of 8"),
    (["--target-cc", "eight"], "--target-cc takes compute capabilities"),
    (["--backend", "tensorrt-nano"], "unknown TensorRT flavour 'tensorrt-nano'"),
    (["--onnx-precision", "fp4"], "invalid choice: 'fp4'"),
]


@pytest.mark.parametrize("args, message", BUILD_ERRORS, ids=[" ".join(a) for a, _ in BUILD_ERRORS])
def test_build_engines_usage_errors_create_nothing(args, message, tmp_path, a_file, tiny, capsys):
    from demo.cli.build_engines import main

    args = [a.format(file=a_file, tmp=tmp_path) for a in args]
    status = main([*engine_args(tmp_path), *args])
    line = one_error_line(capsys.readouterr().err, "build-engines")
    assert status == 2 and message.format(file=a_file, tmp=tmp_path) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("args, message", [
    (["--onnx-dir", "{file}/x"], "ONNX directory '{file}/x' cannot be written: '{file}' is not a directory"),
    (["--stages", "unet,text"], "unknown stage(s) text"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_export_onnx_usage_errors_create_nothing(args, message, tmp_path, a_file, tiny, capsys):
    from demo.cli.export_onnx import main

    args = [a.format(file=a_file) for a in args]
    status = main(["--model", "tiny", "--onnx-dir", str(tmp_path / "onnx"), *args])
    line = one_error_line(capsys.readouterr().err, "export-onnx")
    assert status == 2 and message.format(file=a_file) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_target_the_flavour_cannot_build_for_fails_cleanly(tmp_path, capsys):
    """Checked against TensorRT's own list of targets before anything is exported or built."""
    from demo.cli.build_engines import main

    args = [a if a != "8.6" else "9.0" for a in engine_args(tmp_path)]
    status = main(args)
    line = one_error_line(capsys.readouterr().err, "build-engines")
    assert status == 2 and "cannot target compute capability 9.0" in line
    assert not (tmp_path / "engine").exists() and not (tmp_path / "onnx").exists()
    assert_clean(tmp_path)


def test_the_largest_seed_torch_takes_is_accepted(tmp_path, tiny, capsys):
    from demo.cli.generate import main

    seed = 2**64 - 1
    status = main(["a prompt", "--output-dir", str(tmp_path), "--seed", str(seed), "--denoising-steps", "1",
                   "--num-warmup-runs", "0", "--scheduler", "DDIM"])
    assert status == 0, capsys.readouterr().err
    assert json.loads((tmp_path / f"tiny-seed{seed}.json").read_text())["seed"] == seed
    assert staging_leftovers(tmp_path) == []


# ---- damaged caches: rebuilt, with the reason ---------------------------------------------------------

def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


@pytest.mark.parametrize("artifact, damage, flags, reason", [
    # Fault 7: same size, one byte flipped; the engine must come from a verified ONNX, not from this one.
    ("onnx/clip.opt.onnx", flip_middle_byte, ["--force-engine-build"],
     "clip.opt.onnx is corrupt (content hash differs)"),
    ("onnx/clip.opt.onnx", truncate, ["--force-engine-build"], "clip.opt.onnx is truncated or corrupt (1000 bytes"),
    ("onnx/clip.onnx", flip_middle_byte, ["--force-onnx-optimize", "--force-engine-build"],
     "clip.onnx is corrupt (content hash differs)"),
    ("engine/clip.engine", flip_middle_byte, [], "clip.engine is corrupt (content hash differs)"),
    ("engine/clip.engine", truncate, [], "clip.engine is truncated or corrupt (1000 bytes"),
    ("engine/clip.engine", Path.unlink, [], "clip.engine is missing"),
], ids=["flipped-opt-onnx", "truncated-opt-onnx", "flipped-onnx", "flipped-engine", "truncated-engine",
        "deleted-engine"])
def test_damaged_artifacts_are_rebuilt(artifact, damage, flags, reason, work, capsys):
    damage(work / artifact)
    out = build_in_process(work, capsys, *flags)
    assert f"[cache] {Path(artifact).name}: building ({reason}" in out
    # The ONNX is rebuilt before the engine is built from it (the engine comes last in the log).
    assert out.index(f"[cache] {Path(artifact).name}: building") < out.index("[build] clip: building the engine")
    assert_clean(work)


MANIFESTS = {"list": b"[]", "string": b'"x"', "key-not-a-dict": b'{"key": 1}',
             "files-not-a-dict": b'{"key": {}, "files": []}', "not-json": b"\x00{garbage", "deleted": None}


@pytest.mark.parametrize("manifest", list(MANIFESTS.values()), ids=list(MANIFESTS))
def test_manifests_that_are_not_manifests_mean_not_built(manifest, work, capsys):
    """Fault 3: valid JSON of the wrong shape (or none at all) is replaced, never trusted or crashed on."""
    for artifact in ("onnx/clip.opt.onnx", "engine/clip.engine"):
        path = work / (artifact + ".json")
        path.unlink() if manifest is None else path.write_bytes(manifest)
    out = build_in_process(work, capsys)
    assert "[cache] clip.engine: building (not built yet)" in out
    assert "[cache] clip.opt.onnx: building (not built yet)" in out
    assert_clean(work)


# ---- killed builds: what they left is removed by the next run ----------------------------------------

def start(args: list, pause: str | None = None, merge_output: bool = False) -> subprocess.Popen:
    """A Python process in the checkout, unbuffered; with `pause` (`<artifact>:<point>`), it stops there (see
    tests/paused.py)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if pause:
        args = [ROOT / "tests" / "paused.py", pause, *args]
    return subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT, env=env, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_output else subprocess.PIPE)


def wait_for_line(stream, text: str) -> str:
    """Read `stream` up to a line containing `text`; returns everything read (ends early at end of stream)."""
    seen = []
    for line in stream:
        seen.append(line)
        if text in line:
            break
    return "".join(seen)


def test_killed_build_leaves_nothing_the_next_run_keeps(work, capsys):
    """Fault 4: kill -9 in the middle of an engine build that is re-exporting its ONNX (three staging folders:
    engine, optimized ONNX, exported ONNX). The next run removes them under each artifact's lock and rebuilds."""
    build = start([BUILD_ENGINES, *engine_args(work, "--force-onnx-export", "--force-engine-build")],
                  pause="clip.onnx:building")
    seen = wait_for_line(build.stderr, "[test] paused at clip.onnx:building")
    assert "[test] paused" in seen, seen + build.stderr.read()
    build.send_signal(signal.SIGKILL)
    build.communicate()
    assert build.returncode == -signal.SIGKILL
    left = [p.name.split(".build-")[0] for p in staging_leftovers(work)]
    assert sorted(left) == [".clip.engine", ".clip.onnx", ".clip.opt.onnx"]

    out = build_in_process(work, capsys)
    for name in ("clip.engine", "clip.opt.onnx", "clip.onnx"):
        assert f"[cache] {name}: building (not built yet)" in out
    assert_clean(work)


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_interrupted_build_says_so_and_leaves_nothing(work, signum, status, capsys):
    """Ctrl-C or a TERM in the middle of a build (three staging folders made): the command stops there, removes
    its staging on the way out, says "interrupted" in one line and exits 130 / 143; the next run rebuilds."""
    build = start([BUILD_ENGINES, *engine_args(work, "--force-onnx-export", "--force-engine-build")],
                  pause="clip.onnx:building")
    seen = wait_for_line(build.stderr, "[test] paused at clip.onnx:building")
    assert "[test] paused" in seen, seen + build.stderr.read()
    build.send_signal(signum)
    _, err = build.communicate(timeout=120)
    assert build.returncode == status, err
    assert err.strip().splitlines() == ["build-engines: interrupted"]
    assert staging_leftovers(work) == []

    out = build_in_process(work, capsys)
    assert "[cache] clip.onnx: building (not built yet)" in out
    assert_clean(work)


def test_killed_atomic_writes_are_removed_but_live_ones_kept(tmp_path):
    """Atomic writes outside any lock (images, the built-in model folder, the timing cache): a dead writer's
    staging is removed by the next writer of that name; a live writer's (this process) and another host's stay."""
    from core.atomic import atomic_directory, atomic_file, atomic_write_bytes

    folder, file = tmp_path / "model", tmp_path / "timing.cache"
    writer = start(["-c", "import sys; from pathlib import Path\n"
                          "from core.atomic import atomic_directory, atomic_file\n"
                          "with atomic_directory(Path(sys.argv[1])) as d, atomic_file(Path(sys.argv[2])) as f:\n"
                          "    (d / 'half').write_bytes(b'x'); f.write_bytes(b'half'); print('ready')\n"
                          "    sys.stdin.readline()",
                    folder, file])
    assert writer.stdout.readline() == "ready\n"
    writer.send_signal(signal.SIGKILL)
    writer.communicate()
    dead = staging_leftovers(tmp_path)
    assert len(dead) == 2
    elsewhere = tmp_path / ".timing.cache.tmp-otherhost-1-abcdefgh"
    elsewhere.write_bytes(b"another machine's, on a shared disk")

    with atomic_file(file) as live:
        live.write_bytes(b"in progress")
        atomic_write_bytes(file, b"cache")
        assert live.exists()  # ours, still being written
    with atomic_directory(folder) as staging:
        (staging / "config.json").write_text("{}")
    assert staging_leftovers(tmp_path) == [elsewhere]
    assert file.read_bytes() == b"in progress" and (folder / "config.json").exists()


# ---- concurrent builds: both succeed, neither sees the other's half-built files ------------------------

def test_forced_fp32_and_fp16_builds_into_the_same_folders_both_succeed(work):
    """Fault 5: --force-onnx-export --force-engine-build twice at once, in two precisions, same folders."""
    fp16 = [a if a != "fp32" else "fp16" for a in engine_args(work)]
    runs = [start([BUILD_ENGINES, *args, "--force-onnx-export", "--force-engine-build"])
            for args in (engine_args(work), fp16)]
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err
    assert_clean(work)
    # Whichever finished last left an engine keyed by the ONNX it left.
    engine_key = json.loads((work / "engine/clip.engine.json").read_text())["key"]
    onnx_key = json.loads((work / "onnx/clip.opt.onnx.json").read_text())["key"]
    assert engine_key["onnx"]["dtype"] == onnx_key["dtype"]


def test_a_run_that_meets_a_build_under_way_waits_for_it_and_reuses_it(tmp_path):
    first = start([BUILD_ENGINES, *engine_args(tmp_path), "--verbose"], pause="clip.onnx:building")
    seen = wait_for_line(first.stderr, "[test] paused at clip.onnx:building")
    assert "[test] paused" in seen, seen + first.stderr.read()
    second = start([BUILD_ENGINES, *engine_args(tmp_path), "--verbose"], merge_output=True)
    waited = wait_for_line(second.stdout, "[cache] clip.engine: waiting for another process")
    out, err = first.communicate(input="\n", timeout=600)
    assert first.returncode == 0, err
    rest, _ = second.communicate(timeout=600)
    assert second.returncode == 0, waited + rest
    for name in ("clip.engine", "clip.opt.onnx", "clip.onnx"):
        assert f"[cache] {name}: building (not built yet)" in out
    assert "waiting for another process" in waited and "[cache] clip.engine: up to date" in rest
    assert ": building" not in waited + rest
    assert_clean(tmp_path)


def test_an_engine_is_built_from_the_onnx_it_was_given(work, prepared, tmp_path):
    """A build holds the ONNX's lock from preparing it until the engine is built from it: a rival exporting
    the same ONNX folder in another precision waits, instead of swapping the file under the build."""
    report = tmp_path / "fp32.json"
    fp32 = start([BUILD_ENGINES, *engine_args(work, "--force-engine-build", "--report", report)],
                 pause="clip.opt.onnx:done")
    seen = wait_for_line(fp32.stderr, "[test] paused at clip.opt.onnx:done")
    assert "[test] paused" in seen, seen + fp32.stderr.read()
    rival_args = [a if a != "fp32" else "fp16" for a in ENGINE_ARGS]
    rival = start([BUILD_ENGINES, *rival_args, "--onnx-dir", work / "onnx", "--engine-dir", tmp_path / "rival",
                   "--force-onnx-export", "--verbose"], merge_output=True)
    seen = wait_for_line(rival.stdout, "[cache] clip.opt.onnx: waiting for another process")
    _, err = fp32.communicate(input="\n", timeout=600)
    assert fp32.returncode == 0, err
    out, _ = rival.communicate(timeout=600)
    assert rival.returncode == 0, seen + out
    # What the fp32 build was handed, and what it built, is the fp32 ONNX (its engine is as large as the
    # prepared fp32 one; one built from the rival's fp16 ONNX holds half-size weights).
    fp32_onnx = json.loads((prepared / "onnx/clip.opt.onnx.json").read_text())["files"]
    assert json.loads(report.read_text())["stages"]["clip"]["onnx_bytes"] == sum(f["size"] for f in fp32_onnx.values())
    assert (work / "engine/clip.engine").stat().st_size == (prepared / "engine/clip.engine").stat().st_size
    assert json.loads((work / "onnx/clip.opt.onnx.json").read_text())["key"]["dtype"] == "float16"
    assert_clean(tmp_path)


# ---- a full disk while saving: nothing of the set is left, one line, exit 1 --------------------------------

@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 64 KiB tmpfs where mounting works (root on Linux); elsewhere a folder whose staged writes fail with
    ENOSPC after the first, as a full disk's would."""
    import errno
    import pathlib

    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                             capture_output=True).returncode == 0
    if not mounted:
        writes = []
        real = pathlib.Path.write_bytes

        def write_bytes(self, data):
            if ".tmp-" in self.parent.name and str(self).startswith(str(mount)):
                writes.append(self)
                if len(writes) > 1:
                    raise OSError(errno.ENOSPC, "No space left on device")
            return real(self, data)

        monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)
    yield mount
    if mounted:
        subprocess.run(["umount", str(mount)], check=True)


def test_full_disk_while_saving_leaves_no_part_of_the_set(small_disk, tiny, capsys):
    from demo.cli.generate import main

    args = ["a prompt", "--output-dir", str(small_disk), "--denoising-steps", "2", "--num-warmup-runs", "0",
            "--seed", "3"]
    assert main([*args, "--batch-size", "8"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (f"demo-diffusion: error: cannot save the images in {small_disk}: No space left on device "
                         "(nothing was written)")
    assert list(small_disk.iterdir()) == []  # no PNG, no report, no staging

    assert main([*args, "--batch-size", "1"]) == 0  # a later normal run works, under the first run's names
    assert sorted(p.name for p in small_disk.iterdir()) == ["tiny-seed3-0.png", "tiny-seed3.json"]
