"""A newcomer's friction (issue 55): a missing --model path said to be missing, the shipped outline LoRA by its
built-in name, the README's flag-table footnotes told apart from defaults and its report-gpus example drawn from the
headline's own measurement, the client's --help promising only what it writes, and what sd-serve says before
Triton starts (options that change nothing in the run, Triton's CUDA lines on a machine without a GPU) or refuses
(a damaged ControlNet folder, several control images in one request)."""

import re
import shlex

import numpy as np
import pytest
import torch

from core.errors import RunFailure, UsageError
from tests.conftest import ROOT
from tests.test_serve import free_ports, inputs, plan_for


@pytest.mark.parametrize("given", ["./no/such/dir", "{tmp}/x", "~/no-such-model-folder", "no/such/model.safetensors",
                                   "weights.ckpt", "a/b/c"])
def test_a_missing_model_path_is_no_such_file_or_directory(given, tmp_path, capsys):
    """Issue: `--model ./no/such/dir` read "unknown model ...: not a built-in, not a diffusers-format directory, ...";
    `no/such/model.safetensors` (owner/name's form) was looked up on the hub."""
    from demo.cli.generate import main
    from models.source import resolve_model

    given = given.format(tmp=tmp_path)
    with pytest.raises(UsageError, match=f"^{re.escape(f'refiner {given}: no such file or directory')}$"):
        resolve_model(given, given="refiner")
    assert main(["a cat", "--model", given, "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"demo-diffusion: error: --model {given}: no such file or directory\n"
    with pytest.raises(UsageError, match="^unknown model 'no-such-model': not a built-in"):  # a name stays a name
        resolve_model("no-such-model")


def test_the_shipped_outline_lora_goes_by_its_builtin_name(monkeypatch):
    """Issue: the outline LoRA shipped with `shapes` worked only by its repository path."""
    from demo.cli.to_spec import parse_lora_spec
    from demo.runtime.loader import plan_pipeline
    from demo.runtime.spec import PipelineSpec
    from models import shapes
    from models.lora import read_lora

    lora = read_lora("shapes-outline")
    assert lora.path == str(shapes.OUTLINE_LORA) and lora.layers
    assert parse_lora_spec("shapes-outline:0.5") == ("shapes-outline", 0.5)
    plan = plan_pipeline(PipelineSpec(model="shapes", backend="torch", loras=(("shapes-outline", 0.5),)), "cpu")
    assert [(file.path, scale) for file, scale in plan.loras] == [(str(shapes.OUTLINE_LORA), 0.5)]
    with pytest.raises(UsageError,
                       match=r"^LoRA shapes-outlin: no such file \(nor a built-in LoRA: shapes-outline, shapes-lcm\)"):
        read_lora("shapes-outlin")
    monkeypatch.setattr(shapes, "damage", lambda: "outline.safetensors is not the file recorded in weights.sha256")
    with pytest.raises(RunFailure, match="^LoRA shapes-outline: the LoRA shipped with the package is damaged"):
        read_lora("shapes-outline")


def readme_flag_table() -> tuple[list[str], str]:
    """The README's demo-diffusion flag table's rows and the text after it, to the next section."""
    section = (ROOT / "README.md").read_text().split("## demo-diffusion flags\n", 1)[1].split("\n## ", 1)[0]
    lines = section.strip().splitlines()
    rows = [line for line in lines if line.startswith("|")]
    return rows, "\n".join(line for line in lines if not line.startswith("|"))


def test_the_readme_flag_tables_footnotes_cannot_be_read_as_values():
    """Issue: "repeatable (3)" and "((2))" read as defaults, in a table whose parentheses hold the defaults. A mark
    is [n] after the row's text; each marked row's note is there below the table, and every note is marked."""
    rows, notes = readme_flag_table()
    marked = {mark for row in rows for mark in re.findall(r"\[(\d)\] \|$", row)}
    noted = set(re.findall(r"^\[(\d)\] ", notes, re.M))
    assert marked == noted == {"1", "2", "3"}
    assert not [row for row in rows if re.search(r"\(\(|: \(\d\)|, repeatable \(|` \(\d\) \|", row)]


def test_the_readme_report_gpus_example_shows_the_headlines_measurement(capsys):
    """Issue: the example merged the archive's 2026-11-22 benchmarks, where our kernels were slower than none,
    against the README's headline (2026-11-29). The report files it names reproduce every figure of the headline
    table."""
    from bench.gpu_report import main

    text = (ROOT / "README.md").read_text()
    headline = text.split("| path | ms per image |", 1)[1].split("\n\n", 1)[0]
    figures = re.findall(r"\| ([\d.]+) \|$", headline, re.M)
    assert len(figures) == 4
    command = next(line for line in text.splitlines() if line.startswith("report-gpus "))
    files = [arg for arg in shlex.split(command)[1:] if arg.startswith("results/")]
    assert files and all((ROOT / name).is_file() for name in files)
    assert main([str(ROOT / name) for name in files]) == 0
    table = capsys.readouterr().out
    assert all(f"| {figure} |" in table for figure in figures), (figures, table)


def test_the_clients_help_promises_only_the_png():
    """Issue: `client.py --help` said its --output-dir is "where images and the report go"; it writes the PNG
    alone."""
    from demo.cli.client import build_parser

    (output_dir,) = [action for action in build_parser()._actions if action.dest == "output_dir"]
    assert "report go" not in output_dir.help and "PNG" in output_dir.help and "no report" in output_dir.help


def test_sd_serve_notes_options_that_change_nothing_and_triton_cuda_lines_without_a_gpu(tiny):
    """Before Triton starts: --max-queue-delay-ms where no request can wait for others (--max-batch-size 1, or a
    model serving image requests only, each alone) is a note; so, on a machine without a GPU, are Triton's CUDA
    error lines, which looked like failures."""
    from demo.serve.options import ServeOptions
    from demo.serve.server import startup_notes

    cpu, gpu = [torch.device("cpu")], [torch.device("cuda", 0)]
    delay = ServeOptions(max_queue_delay_ms=5)
    alone = "max_queue_delay_ms\x1f unused: no request waits for others to batch with"
    cuda_lines = "no CUDA GPU here: the two lines Triton logs about CUDA"
    batched = startup_notes(plan_for(max_batch_size=4), delay, gpu)
    assert not any(alone in note for note in batched) and not any(cuda_lines in note for note in batched)
    (note,) = [note for note in startup_notes(plan_for(max_batch_size=1), delay, gpu) if alone in note]
    assert note.endswith("(\x1fmax_batch_size\x1f is 1)")
    (note,) = [note for note in startup_notes(plan_for(model="tiny-inpaint"), delay, gpu) if alone in note]
    assert note.endswith("(model 'tiny-inpaint' serves image requests only, each run alone)")
    assert not any(alone in note for note in startup_notes(plan_for(max_batch_size=1), ServeOptions(), gpu))
    assert [note for note in startup_notes(plan_for(), ServeOptions(), cpu) if cuda_lines in note]


def test_sd_serve_refuses_a_damaged_controlnet_folder_in_one_line(tmp_path, capsys):
    """Issue: `sd-serve --controlnet` with a damaged folder was a traceback before Triton started."""
    from demo.cli.serve import main

    damaged = tmp_path / "controlnet"
    damaged.mkdir()
    (damaged / "config.json").write_text("{not JSON")
    http, grpc, metrics = free_ports(3)
    assert main(["--controlnet", str(damaged), "--http-port", str(http), "--grpc-port", str(grpc),
                 "--metrics-port", str(metrics)]) == 2
    err = capsys.readouterr().err.split("...\n")[-1]  # after a built-in's generation, on a cold cache
    assert err.startswith(f"sd-serve: error: --controlnet {damaged}: ") and "JSON" in err and err.count("\n") == 1, err


def test_several_control_images_in_one_request_are_refused_naming_the_control_image():
    """Issue: a request of two control images (each other input repeated to match, as Triton's batch dimension
    needs) was refused naming the prompt. A request whose inputs disagree on that dimension is Triton's to refuse
    (docs/serving.md)."""
    from demo.serve.schema import RequestRejected, parse_request

    plan = plan_for(controlnets=(("tiny-controlnet", 0.5),))
    two = np.zeros((2, 64, 64, 3), np.uint8)
    request = {name: np.repeat(array, 2, axis=0) for name, array in inputs(prompt="a castle", steps=2).items()}
    with pytest.raises(RequestRejected, match=re.escape("control_image_0: one image per request (shape [1, H, W, 3]), "
                                                        "got shape [2, 64, 64, 3]")):
        parse_request({**request, "control_image_0": two}, plan)
