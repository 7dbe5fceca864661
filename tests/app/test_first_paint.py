"""How app/first_paint.py reads pictures of the screen (the launch itself is watched by the
walkthrough's test): synthetic pictures, no display needed."""
from __future__ import annotations

from PIL import Image, ImageDraw

from app.first_paint import FirstPaint, Frame, classify

BACKGROUND = (235, 235, 235)


def picture(kind: str):
    """A 400x300 screen with a 320x240 window at its top left, showing `kind`."""
    image = Image.new("RGB", (400, 300), (0, 0, 0))
    if kind == "nothing":
        return image
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, 319, 239), fill=BACKGROUND)
    if kind == "curtain":
        draw.rectangle((100, 96, 220, 100), fill=(26, 26, 26))    # its line, mid-window
    if kind in ("half drawn", "form"):
        draw.rectangle((10, 5, 60, 20), fill=(59, 142, 208))       # a button's shape
    if kind == "form":
        draw.rectangle((20, 60, 70, 64), fill=(26, 26, 26))       # a label's text
        draw.rectangle((10, 220, 150, 225), fill=(26, 26, 26))    # the status line
    return image


def launch(*kinds: str) -> FirstPaint:
    result = FirstPaint("400x300", [Frame(0.5 * i, image=picture(k)) for i, k in enumerate(kinds)])
    classify(result.frames)
    return result


def test_each_picture_is_read_as_what_it_shows():
    result = launch("nothing", "blank", "curtain", "half drawn", "form")
    assert [f.kind for f in result.frames] == ["nothing", "blank", "curtain", "half drawn", "form"]
    assert (result.window_s, result.complete_s, result.first("form")) == (0.5, 1.0, 2.0)
    assert result.reveal_s == 0.5                         # seen partly drawn while uncovered
    assert all(result.checks()[i][0] for i in range(2))


def test_the_status_line_is_left_out_of_the_comparison():
    result = launch("curtain", "form")
    earlier = picture("form")                            # its status line said another thing
    ImageDraw.Draw(earlier).rectangle((10, 220, 150, 225), fill=BACKGROUND)
    result.frames.insert(1, Frame(0.7, image=earlier))
    classify(result.frames)
    assert [f.kind for f in result.frames] == ["curtain", "form", "form"]
    assert result.reveal_s == 0.0 and result.checks()[1][0]


def test_a_form_seen_half_built_or_before_the_curtain_fails_the_check():
    for kinds in (("nothing", "half drawn", "curtain", "form"),      # half built, then covered
                  ("nothing", "blank", "half drawn", "form"),        # no curtain (as before)
                  ("nothing", "curtain", "half drawn", "curtain", "form"),
                  ("nothing", "curtain", "curtain")):                # never the form
        result = launch(*kinds)
        assert not result.checks()[1][0], kinds
