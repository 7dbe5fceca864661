"""Sample prompts with per-prompt settings, in the line syntax kohya's sd-scripts users write.

A line is the prompt, then optional flags, each a double dash, a letter and a value:

    a red circle on a blue background --n blurry, text --w 768 --h 512 --d 7 --s 30 --l 6.5

`--n` negative prompt, `--w` / `--h` width / height in pixels, `--d` seed, `--s` denoising
steps, `--l` guidance scale; a flag left out takes the `sampling.*` setting (the seed:
`sampling.seed` + the prompt's index). Lines come from `sampling.prompts` and, after them, from
`sampling.prompts_file` (one per line; blank lines and lines starting with `#` are skipped).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modules.config.problems import Problem

if TYPE_CHECKING:
    from modules.config.schema import Config

# flag -> (SamplePrompt field, what the value must be, parser, lowest, highest)
FLAGS: dict[str, tuple[str, str, type, float, float]] = {
    "n": ("negative", "", str, 0, 0),
    "w": ("width", "a width in pixels, a multiple of 8 from 64 to 4096", int, 64, 4096),
    "h": ("height", "a height in pixels, a multiple of 8 from 64 to 4096", int, 64, 4096),
    "d": ("seed", "a seed from 0 to 4294967295", int, 0, 2**32 - 1),
    "s": ("steps", "denoising steps from 1 to 1000", int, 1, 1000),
    "l": ("guidance_scale", "a guidance scale from 0 to 100", float, 0.0, 100.0),
}
_FLAG = re.compile(r"(?:^|\s)--([A-Za-z]+)(?=\s|$)")


@dataclass(frozen=True)
class SamplePrompt:
    text: str
    negative: str
    width: int
    height: int
    seed: int
    steps: int
    guidance_scale: float


def parse_prompt(line: str, defaults: SamplePrompt, where: str,
                 context: str = "") -> tuple[SamplePrompt, list[Problem]]:
    """One line as a SamplePrompt over `defaults`, and its problems: each names the field
    `where` and, in its message, `context` (a prompts file's line number)."""
    marks = list(_FLAG.finditer(line))
    text = line[:marks[0].start()] if marks else line
    prompt, problems = replace(defaults, text=text.strip()), []
    if not prompt.text:
        problems.append(Problem(where, "a prompt before its --flags" if marks
                                else "a non-empty prompt", repr(line), context))
    for mark, following in zip(marks, [*marks[1:], None]):
        flag = mark.group(1)
        value = line[mark.end():following.start() if following else len(line)].strip()
        if flag not in FLAGS:
            problems.append(Problem(where, "flags among " + ", ".join(f"--{f}" for f in FLAGS),
                                    f"--{flag}", context or "kohya's sample-prompt flags"))
            continue
        name, expected, kind, low, high = FLAGS[flag]
        if kind is str:
            text_field: dict[str, Any] = {name: value}  # the FLAGS row names the field
            prompt = replace(prompt, **text_field)
            continue
        try:
            number = kind(value)
        except ValueError:
            problems.append(Problem(where, f"--{flag}: {expected}", repr(value), context))
            continue
        if not low <= number <= high or (flag in "wh" and number % 8):
            problems.append(Problem(where, f"--{flag}: {expected}", value, context))
            continue
        prompt = replace(prompt, **{name: number})
    return prompt, problems


def prompt_defaults(config: Config, index: int) -> SamplePrompt:
    s = config.sampling
    return SamplePrompt("", s.negative_prompt, config.data.resolution, config.data.resolution,
                        s.seed + index, s.steps, s.guidance_scale)


def prompt_file_lines(path: str) -> list[tuple[int, str]]:
    """(line number, text) of each prompt line of a prompts file (OSError or
    UnicodeDecodeError when it cannot be read)."""
    text = Path(path).read_text(encoding="utf-8")
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), start=1)
            if line.strip() and not line.strip().startswith("#")]


def sample_prompts(config: Config, read_file: bool = True) -> tuple[list[SamplePrompt], list[Problem]]:
    """Every sample prompt of the config, with the problems of its lines. `read_file=False`
    parses only `sampling.prompts` (validation without opening files)."""
    lines = [(f"sampling.prompts[{i}]", "", line)
             for i, line in enumerate(config.sampling.prompts)]
    prompts_file = config.sampling.prompts_file
    if read_file and prompts_file:
        try:
            lines += [("sampling.prompts_file", f"{prompts_file}, line {n}", line)
                      for n, line in prompt_file_lines(prompts_file)]
        except (OSError, UnicodeDecodeError) as exc:
            return [], [Problem("sampling.prompts_file", "a readable UTF-8 text file",
                                repr(prompts_file), str(exc))]
    prompts, problems = [], []
    for index, (where, context, line) in enumerate(lines):
        prompt, found = parse_prompt(line, prompt_defaults(config, index), where, context)
        prompts.append(prompt)
        problems += found
    return prompts, problems
