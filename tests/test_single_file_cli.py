"""Single-file checkpoints through the faces users take: `demo-diffusion --model FILE --model-config DIR` draws the
folder's image (converted once, offline, into the model cache), `--vae FILE` the folder's, a refiner file is read with
the built-in refiner's configs, and what cannot be is one line (exit 2). (ControlNet files: tests/test_single_file.py,
tensor for tensor.)"""

import numpy as np
import pytest
from PIL import Image

from models.controlnet import resolve_controlnet
from models.source import resolve_model
from tests.single_files import write_model_file, write_vae_file

DRAW = ["a red circle", "--backend", "torch", "--denoising-steps", "3", "--seed", "4", "--num-warmup-runs", "0"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    work = tmp_path_factory.mktemp("single-file-cli")
    tiny, refiner = resolve_model("tiny"), resolve_model("tiny-xl-refiner")
    return {"sd1": write_model_file(tiny.path, "sd1", work / "tiny.safetensors"),
            "vae": write_vae_file(tiny.path / "vae", work / "vae.safetensors", "first_stage_model."),
            "refiner": write_model_file(refiner.path, "sdxl-refiner", work / "refiner.safetensors"),
            "tiny": tiny.path, "tiny-controlnet": resolve_controlnet("tiny-controlnet").path}


def draw(tmp_path, name, *args) -> tuple[np.ndarray, str]:
    from demo.cli.generate import main

    out = tmp_path / name
    assert main([*DRAW, "--output-dir", str(out), *args]) == 0
    png = next(out.glob("*.png"))
    return np.asarray(Image.open(png)), png.name


def test_a_single_file_draws_the_image_of_the_folder_it_came_from(files, tmp_path, capsys):
    folder, _ = draw(tmp_path, "folder", "--model", str(files["tiny"]))
    capsys.readouterr()
    ours, name = draw(tmp_path, "file", "--model", str(files["sd1"]), "--model-config", str(files["tiny"]))
    assert "converting" in capsys.readouterr().err  # the first run converts
    assert np.array_equal(ours, folder) and ours.std() > 5
    assert name.startswith("tiny.safetensors-seed4")
    again, _ = draw(tmp_path, "again", "--model", str(files["sd1"]), "--model-config", str(files["tiny"]))
    assert "converting" not in capsys.readouterr().err and np.array_equal(again, folder)  # the second converts nothing


def test_a_single_file_vae_decodes_as_its_folder(files, tmp_path):
    folder, _ = draw(tmp_path, "folder", "--model", "tiny", "--vae", str(files["tiny"] / "vae"))
    ours, _ = draw(tmp_path, "file", "--model", "tiny", "--vae", str(files["vae"]))
    assert np.array_equal(ours, folder)


def test_a_single_file_refiner_is_read_with_the_built_in_refiner_architecture(files, tmp_path, capsys):
    """A refiner file's configs are SDXL 1.0 refiner's (tiny's tensors do not fit them: the configs are used and
    checked, without a full-size model built)."""
    from demo.cli.generate import main

    code = main([*DRAW, "--output-dir", str(tmp_path / "out"), "--model", "tiny-xl", "--refiner",
                 str(files["refiner"])])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and f"--refiner {files['refiner']}: component 'unet' does not fit the built-in sdxl-refiner" \
        in line


@pytest.mark.parametrize("args, message", [
    (["--model", "tiny", "--model-config", "x"],
     "--model-config describes a single-file model; model 'tiny' is not a file"),
    (["--model", "tiny", "--prediction-type", "v_prediction"], "--prediction-type describes a single-file model"),
    # converted with the built-in SDXL refiner's configs, which a tiny SD 1.x file does not fit
    (["--model", "tiny-xl", "--refiner", "{sd1}"], "--refiner {sd1}: component 'unet' does not fit the built-in sd1"),
    (["--model", "{sd1}", "--model-config", "{tiny-controlnet}"], "model_index.json is missing"),
])
def test_what_a_single_file_cannot_be_is_one_line(files, tmp_path, capsys, args, message):
    from demo.cli.generate import main

    names = {key: str(value) for key, value in files.items()}
    code = main([*DRAW, "--output-dir", str(tmp_path / "out"), *(arg.format(**names) for arg in args)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("demo-diffusion: error: ") and message.format(**names) in lines[-1]
    assert not (tmp_path / "out").exists()
