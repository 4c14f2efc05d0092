"""What the tools/ scripts share at their command lines: argparse types that refuse a bad value in
one sentence (argparse prints it with the usage and exits 2), a parser whose description is the
tool's first docstring paragraph, and the check that a GPU tool has the GPUs it needs."""

from __future__ import annotations

import argparse
import sys


def parser(doc: str) -> argparse.ArgumentParser:
    """An ArgumentParser described by the first paragraph of `doc` (a module docstring)."""
    return argparse.ArgumentParser(description=" ".join(doc.strip().split("\n\n")[0].split()))


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive whole numbers, e.g. 1,16,64."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty list")
    return [positive_int(part.strip()) for part in text.split(",")]


def preset(name: str) -> str:
    """A preset's name (flexsgl/model/presets.py)."""
    from flexsgl.model.presets import PRESETS

    if name not in PRESETS:
        raise argparse.ArgumentTypeError(f"{name!r} is not a preset; choose one of {', '.join(sorted(PRESETS))}")
    return name


def need_gpus(tool: str, count: int = 1) -> None:
    """Exit with one sentence (status 1) where this machine has fewer than `count` CUDA GPUs."""
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < count:
        sys.exit(f"{tool} needs {count} CUDA GPU{'s' if count > 1 else ''}; this machine has {have}.")
