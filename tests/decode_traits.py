"""The decode kernels' per-format traits as cc/sm80/decode/config.h states them (FormatTraits<KvFormat::k...>), read
from the source so that a CPU test can check the Python that mirrors them (the split rule, decode_timeline.py)."""

from __future__ import annotations

import pathlib
import re

from jax_msa import KVFormat

CONFIG_H = pathlib.Path(__file__).resolve().parent.parent / "cc" / "sm80" / "decode" / "config.h"
_NAMES = {KVFormat.BF16: "Bf16", KVFormat.FP8: "Fp8", KVFormat.NVFP4: "Nvfp4"}


def format_traits(field: str) -> dict:
    """{KVFormat: int} of FormatTraits' `static constexpr int <field> = N;` for each format."""
    config = CONFIG_H.read_text()
    out = {}
    for fmt, name in _NAMES.items():
        body = re.search(rf"struct FormatTraits<KvFormat::k{name}> {{(.*?)\n}};", config, re.S).group(1)
        out[fmt] = int(re.search(rf"static constexpr int {field} = (\d+);", body).group(1))
    return out
