"""The `scenes` detector reads the renderer's images back exactly: random scenes of one to four objects, jittered,
plain and two-tone; its masks lie on the drawn objects, its frequencies and colours are the drawn ones; a blurred,
resized, noisy or compressed image still reads right; and it reads what an image shows, not what its prompt asked
for. CPU only."""

import io
import random
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image, ImageFilter
from scipy import ndimage

from models.scenes import world
from models.scenes.detector import expected_reading, read_image

SCENES = 300
SEED = 1234
PATTERNS = ("striped", "pinstriped", "dotted", "checkered", "outlined")
MASKS_COMPARED = 60  # scenes whose masks are compared with the renderer's layers
MIN_OVERLAP = {"tiny": 0.8, "small": 0.93, "large": 0.96}  # a mask's intersection over union with the drawn one


def _drawn(scene: world.Scene, seed: int):
    """A scene rendered with jitter, and its objects' jittered centres (the same draws from the same seed)."""
    image = world.render(scene, random.Random(seed))
    centres = world.scene_tensors([scene], random.Random(seed))["centre"][0, :len(scene.objects)].tolist()
    return image, centres


@pytest.fixture(scope="module")
def sample():
    """(scene, image, centres, reading) for SCENES random scenes."""
    rng = random.Random(SEED)
    drawn = []
    for i in range(SCENES):
        scene = world.random_scene(rng)
        image, centres = _drawn(scene, SEED + i)
        drawn.append((scene, image, centres, read_image(image)))
    return drawn


def test_every_rendered_scene_reads_back_exactly(sample):
    wrong = [(scene.prompt, reading.as_dict()) for scene, _, _, reading in sample
             if reading.as_dict() != expected_reading(scene)]
    assert not wrong, f"{len(wrong)} of {len(sample)} misread, e.g. {wrong[:3]}"


def test_the_sample_shows_every_attribute_value(sample):
    seen: dict[str, set] = {"shape": set(), "colour": set(), "size": set(), "fill": set(), "place": set()}
    counts, two_tone = set(), set()
    for scene, _, _, _ in sample:
        counts.add(len(scene.objects))
        two_tone.add(scene.background_bottom is not None)
        for o in scene.objects:
            for name, values in seen.items():
                values.add(getattr(o, name))
    assert seen == {"shape": set(world.SHAPES), "colour": set(world.COLOURS), "size": set(world.SIZES),
                    "fill": set(world.FILLS), "place": set(world.PLACES)}
    assert counts == set(range(1, world.MAX_OBJECTS + 1)) and two_tone == {False, True}
    # every fill at every size the world patterns, every shape at every size
    pairs = {(o.fill, o.size) for scene, *_ in sample for o in scene.objects}
    assert {(f, s) for f in world.FILLS for s in world.PATTERNED_SIZES} <= pairs
    assert {(s, z) for s in world.SHAPES for z in world.SIZES} <= {(o.shape, o.size) for scene, *_ in sample
                                                                    for o in scene.objects}


def test_the_masks_lie_on_the_drawn_objects(sample):
    """Each mask's centroid is within a pixel of the jittered centre (a triangle's centroid: a sixth of its side
    below its box's centre), its area is the shape's, and it is the drawn silhouette (the renderer's own layers)."""
    area = {"circle": np.pi / 4, "square": 1.0, "triangle": 0.5}
    for scene, _, centres, reading in sample:
        assert len(reading.objects) == len(scene.objects)
        union = np.zeros((world.SIZE, world.SIZE), dtype=int)
        for o, (x, y), read in zip(scene.objects, centres, reading.objects):
            side = world.SIZES[o.size]
            if o.shape == "triangle":
                y += side / 6
            assert abs(read.centroid[0] - x) <= 1 and abs(read.centroid[1] - y) <= 1, (o, (x, y), read.centroid)
            assert read.mask.dtype == bool and read.mask.shape == (world.SIZE, world.SIZE)
            # its edge's partly covered pixels in or out: some half a pixel a pixel of the perimeter
            assert abs(read.mask.sum() - area[o.shape] * side ** 2) <= 2.5 * side, (o, read.mask.sum())
            union += read.mask
        assert union.max() <= 1  # one object's pixels are no other's
    # against the renderer's own silhouettes (pixels at least half covered, an outline's hole filled), some scenes
    for i, (scene, _, _, reading) in enumerate(sample[:MASKS_COMPARED]):
        cover, _ = world.object_layers(world.scene_tensors([scene], random.Random(SEED + i)))
        for k, (o, read) in enumerate(zip(scene.objects, reading.objects)):
            drawn = ndimage.binary_fill_holes(cover[0, k].numpy() >= 0.5)
            overlap = (drawn & read.mask).sum() / (drawn | read.mask).sum()
            assert overlap >= MIN_OVERLAP[o.size], (o, overlap)


def test_frequencies_and_colours_are_the_drawn_ones(sample):
    frequencies: dict[str, list[float]] = {fill: [] for fill in world.FILLS}
    for scene, _, _, reading in sample:
        for o, read in zip(scene.objects, reading.objects):
            frequencies[o.fill].append(read.frequency)
            # the object's own colour, not its ink's nor its edge's blend with the background
            assert np.abs(np.array(read.rgb) - world.COLOURS[o.colour]).max() <= 3, (o, read.rgb)
    assert max(frequencies["solid"]) < 0.01 and max(frequencies["outlined"]) == 0  # no pattern
    assert np.median(frequencies["striped"]) == pytest.approx(2 / world.STRIPE_PERIOD, rel=0.25)
    assert np.median(frequencies["pinstriped"]) == pytest.approx(2 / world.PINSTRIPE_PERIOD, rel=0.25)
    assert np.median(frequencies["checkered"]) == pytest.approx(4 / world.CHECKER_PERIOD, rel=0.25)  # x and y
    for fill, period in (("striped", world.STRIPE_PERIOD), ("pinstriped", world.PINSTRIPE_PERIOD)):  # every one
        assert all(f == pytest.approx(2 / period, rel=0.25) for f in frequencies[fill]), (
            fill, min(frequencies[fill]), max(frequencies[fill]))
    assert 0.05 < np.median(frequencies["dotted"]) < np.median(frequencies["checkered"])


@pytest.mark.parametrize("fill", PATTERNS)
def test_a_blurred_large_patterned_object_still_reads(fill):
    """As a VAE's or a model's softer image: blurred (and the same image at another size), two-tone behind an
    object that straddles the split too."""
    rng = random.Random(world.FILLS.index(fill))
    for i, (shape, place) in enumerate([(s, p) for s in world.SHAPES for p in ("middle left", "top right")]):
        colour = rng.choice([c for c in world.COLOURS if c not in ("white", "blue")])
        scene = world.Scene((world.SceneObject(shape, colour, "large", fill, place),), "white",
                            "blue" if i % 2 == 0 else None)
        image, _ = _drawn(scene, i)
        blurred = image.filter(ImageFilter.GaussianBlur(1.0))
        assert read_image(blurred).as_dict() == expected_reading(scene), scene.prompt
        larger = image.resize((2 * world.SIZE, 2 * world.SIZE), Image.Resampling.BILINEAR)
        assert read_image(larger).as_dict() == expected_reading(scene), scene.prompt


def test_a_blurred_small_or_tiny_scene_still_reads():
    rng = random.Random(7)
    for i in range(20):
        scene = world.random_scene(rng)
        image, _ = _drawn(scene, i)
        assert read_image(image.filter(ImageFilter.GaussianBlur(1.0))).as_dict() == expected_reading(scene)


def test_a_noisy_scene_still_reads():
    """Noise of a few levels a channel (a model's grain): no pattern appears in a solid object, no stripe turns
    checkered along its halfway edge, no box widens by the noise around it."""
    rng, noise = random.Random(8), np.random.default_rng(8)
    for i in range(20):
        scene = world.random_scene(rng)
        image, _ = _drawn(scene, i)
        noisy = np.asarray(image).astype(np.float64) + noise.normal(0, 8, (world.SIZE, world.SIZE, 3))
        assert read_image(noisy.clip(0, 255).round().astype(np.uint8)).as_dict() == expected_reading(scene)


def test_a_tiny_object_on_the_split_keeps_its_shape_blurred_or_noisy():
    """A tiny object straddling a two-tone background's split, blurred (its edge blends with both halves and with
    the blurred seam) or noisy (a box widened by noise would make a square a circle)."""
    noise = np.random.default_rng(3)
    for i, (shape, place, colour) in enumerate([(s, p, c) for s in world.SHAPES
                                                for p in ("middle left", "middle center", "middle right")
                                                for c in ("red", "green", "yellow")]):
        scene = world.Scene((world.SceneObject(shape, colour, "tiny", "solid", place),), "white", "blue")
        image, _ = _drawn(scene, i)
        noisy = np.asarray(image).astype(np.float64) + noise.normal(0, 10, (world.SIZE, world.SIZE, 3))
        for shown in (image.filter(ImageFilter.GaussianBlur(1.0)), noisy.clip(0, 255).round().astype(np.uint8)):
            assert read_image(shown).as_dict() == expected_reading(scene), scene.prompt


def test_a_tiny_square_in_noise_stays_square():
    """Noise around a tiny square of a colour near its background's (green on black, ...) would widen its box by
    the noise's largest cover, and make it a circle."""
    noise = np.random.default_rng(4)
    for i, ((background, colour), place) in enumerate([(pair, p) for pair in (("black", "green"), ("green", "black"),
                                                                              ("green", "blue"), ("red", "yellow"))
                                                       for p in world.PLACES]):
        scene = world.Scene((world.SceneObject("square", colour, "tiny", "solid", place),), background)
        image, _ = _drawn(scene, i)
        noisy = np.asarray(image).astype(np.float64) + noise.normal(0, 10, (world.SIZE, world.SIZE, 3))
        assert read_image(noisy.clip(0, 255).round().astype(np.uint8)).as_dict() == expected_reading(scene)


def test_a_compressed_seam_is_no_object():
    """JPEG's seam along a two-tone background's split (off both colours and their blends): background."""
    rng = random.Random(5)
    for i in range(10):
        top, bottom = rng.sample(list(world.COLOURS), 2)
        free = [c for c in world.COLOURS if c not in (top, bottom)]
        objects = [world.SceneObject(rng.choice(world.SHAPES), rng.choice(free), "large", rng.choice(world.FILLS),
                                     place) for place in ("middle left", "middle right")]
        scene = world.Scene(tuple(objects), top, bottom)
        image, _ = _drawn(scene, i)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=85)
        assert read_image(Image.open(buffer)).as_dict() == expected_reading(scene), scene.prompt


def test_an_array_reads_as_its_image(sample):
    scene, image, _, reading = sample[0]
    assert read_image(np.asarray(image)).as_dict() == reading.as_dict() == expected_reading(scene)


@pytest.mark.parametrize("bottom", [None, "blue"])
def test_a_background_alone_reads_no_objects(bottom):
    scene = world.Scene((), "white", bottom)
    image = world.render(scene)
    for shown in (image, image.filter(ImageFilter.GaussianBlur(1.5)), image.resize((384, 384))):
        assert read_image(shown).as_dict() == {"background": scene.backdrop, "count": "0", "objects": []}


def test_it_reads_what_is_drawn_not_what_was_asked():
    """An image drawn with another colour (shape, size, fill, place) than the scene's reads as drawn: a misdrawn
    object is read wrong against its prompt."""
    asked = world.Scene((world.SceneObject("circle", "red", "large", "striped", "top left"),
                         world.SceneObject("square", "green", "small", "solid", "bottom right")), "white")
    changes = [{"colour": "blue"}, {"shape": "triangle"}, {"size": "small"}, {"fill": "checkered"},
               {"place": "top center"}]
    for change in changes:
        drawn = asked.with_(objects=world.ordered([replace(asked.objects[0], **change), asked.objects[1]]))
        reading = read_image(world.render(drawn, random.Random(0))).as_dict()
        assert reading == expected_reading(drawn)
        assert reading != expected_reading(asked), change
    # a whole scene's colours swapped: every object reads the colour drawn
    rng = random.Random(11)
    for i in range(10):
        scene = world.random_scene(rng)
        free = [c for c in world.COLOURS if c not in scene.background_colours()]
        swapped = scene.with_(objects=tuple(replace(o, colour=free[(free.index(o.colour) + 1) % len(free)])
                                            for o in scene.objects))
        reading = read_image(world.render(swapped, random.Random(i))).as_dict()
        assert [o["colour"] for o in reading["objects"]] == [o.colour for o in swapped.objects]
        assert reading != expected_reading(scene)
