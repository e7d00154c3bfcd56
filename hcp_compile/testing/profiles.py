"""What the property cases of a device are drawn from (``strategies.py``) and how big they get."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """The ranges of one device's property cases."""

    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    ratios: tuple[int, ...]  # Hq / Hkv
    max_heads_q: int
    max_tokens: dict[str, int]  # per kind of run: "single" (one device), "cp"
    max_elements: dict[str, int]  # tokens * Hq * head dim, per kind of run
    min_tokens: int
    max_docs: int
    components: tuple[str, ...]  # of strategies.LENGTH_COMPONENTS
    short_max: int
    window_sides: tuple[int, ...]
    torch_max_tokens: int  # the torch kernel materializes heads x 1024 x keys scores
    chunk_elements: int  # float64 reference and SDPA baseline: query rows x keys x heads per chunk
    inner: str  # the compiled runs' inner compiler


PROFILES = {
    "cuda": Profile(
        dtypes=("bfloat16", "float16"), head_dims=(64, 96, 128, 256), kv_heads=(1, 2, 4, 8),
        ratios=(1, 2, 4, 8), max_heads_q=32, max_tokens={"single": 65536, "cp": 32768},
        max_elements={"single": 1 << 28, "cp": 1 << 25}, min_tokens=16, max_docs=256,
        components=("empty", "tiny", "short", "edge", "medium", "long"), short_max=255,
        window_sides=(0, 1, 7, 64, 127, 128, 129, 1000, 2048, 4096), torch_max_tokens=16384,
        chunk_elements=1 << 26, inner="inductor",
    ),
    "cpu": Profile(
        dtypes=("float32", "bfloat16"), head_dims=(8, 16), kv_heads=(1, 2), ratios=(1, 2, 4),
        max_heads_q=8, max_tokens={"single": 96, "cp": 96}, max_elements={"single": 1 << 14, "cp": 1 << 14},
        min_tokens=4, max_docs=12, components=("empty", "tiny", "short"), short_max=40,
        window_sides=(0, 1, 2, 5, 9), torch_max_tokens=1 << 20, chunk_elements=1 << 22, inner="aot_eager",
    ),
}


def run_kind(mesh: tuple[int, int]) -> str:
    return "single" if mesh == (1, 1) else "cp"
