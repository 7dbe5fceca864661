"""The dataset box's preview: a caption after the dataset's rules, redrawn when they change,
"Shuffle again", and with masked loss the first image with its mask over it."""
from __future__ import annotations

from PIL import Image

from tests.app.conftest import pump


def preview_of(app):
    view = app.registry.find("data.datasets")
    assert view is not None and view.previews
    return view.previews[0]


def test_the_caption_preview_follows_the_rules_and_shuffles_again(app, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(folder / "a.png")
    (folder / "a.txt").write_text("sks dog, red, grass, sky, tree, sun", encoding="utf-8")
    app.tabview.set("Data")
    binding = app.binding
    binding.set_text("data.datasets[0].path", str(folder))
    binding.set_text("data.datasets[0].caption_prefix", "photo")
    pump(app, until=lambda: "photo, sks dog, red" in preview_of(app).caption_text)
    preview = preview_of(app)
    assert preview.caption_text == "a.png trains as: photo, sks dog, red, grass, sky, tree, sun"
    assert preview.shuffle.cget("state") == "disabled"  # nothing varies yet
    binding.set_value("data.datasets[0].shuffle_tags", True)
    binding.set_text("data.datasets[0].keep_tags", "1")
    pump(app, until=lambda: preview_of(app).shuffle.cget("state") == "normal")
    seen = set()
    for _ in range(6):
        text = preview_of(app).caption_text
        assert text.startswith("a.png trains as: photo, sks dog, ")  # kept tag stays first
        assert sorted(text.split(": ", 1)[1].split(", ")[2:]) == ["grass", "red", "sky", "sun",
                                                                  "tree"]
        seen.add(text)
        preview_of(app).shuffle.invoke()
    assert len(seen) > 1, "Shuffle again drew the same order every time"
    assert preview_of(app).image is None and preview_of(app).mask_text == ""


def test_the_mask_preview_tints_the_left_out_part(app, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    Image.new("RGB", (40, 20), (255, 255, 255)).save(folder / "a.png")
    mask = Image.new("L", (40, 20), 0)
    mask.paste(255, (0, 0, 20, 20))  # the left half counts
    mask.save(folder / "a_mask.png")
    app.tabview.set("Data")
    app.binding.set_text("data.datasets[0].path", str(folder))
    app.binding.set_value("data.masked_loss", True)
    pump(app, until=lambda: preview_of(app).image is not None)
    preview = preview_of(app)
    assert "mask file" in preview.mask_text
    assert "a.png trains as" in preview.caption_text  # the mask is not an image of its own
    image = preview.image
    left, right = image.getpixel((2, image.height // 2)), image.getpixel((image.width - 3,
                                                                          image.height // 2))
    assert left == (255, 255, 255) and right != left and right[0] > right[2]  # tinted red
    app.binding.set_value("data.masked_loss", False)
    pump(app, until=lambda: preview_of(app).image is None)
