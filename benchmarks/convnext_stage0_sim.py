"""ConvNeXt's stage 0 under the caching allocator's rules, simulated apart from the engine.

How it asks batchfit: it does not: the allocator's rules are simulated here by hand, apart
from the engine.

The replay needs more memory for ConvNeXt inference than the cards had (README, "Real
GPUs": convnext_tiny at 768 images of 384 px needs 24,770 MiB of segments; the 3090 has
24,268 MiB and ran it). This script checks that claim without the engine's allocator or
trace: it writes stage 0's events by hand from timm's ``ConvNeXtBlock.forward`` under fp16
autocast in inference, and replays them through a minimal, separately written model of
``DeviceCachingAllocator`` (c10/cuda/CUDACachingAllocator.cpp): best fit by (size,
address), a large block split when more than 1 MiB would remain, neighbours merged on
free, and on a failed cudaMalloc every wholly free segment released and the request
retried once. Sizes are in MiB, in units of one fp16 activation ``u`` (1,296 MiB for
convnext_tiny at 768 x 384 px: 768 x 96 x 96 x 96 x 2 bytes).

Per block, in order: the conv input's fp16 cast ``c`` (u) and the depthwise output ``d``
(u), ``c`` dies; LayerNorm's fp32 input copy ``q`` (2u, autocast's fp32 list) and fp32
output ``n`` (2u); ``q`` and ``d`` die; fc1's fp16 input cast ``f`` (u), its output ``h``
(4u), ``f`` dies; GELU's ``g`` (4u), ``h`` dies; fc2's ``o`` (u), ``g`` and ``n`` die; the
layer-scale product ``m`` (2u, fp32: the fp16 output times the fp32 gamma), ``o`` dies;
the residual sum ``a`` (2u); ``m`` and the previous block's output die. The stage input
(2u, the stem's fp32 LayerNorm2d output, held by ``forward_features``' frame) and the
image (u) stay. The first block's cuDNN search empties the cache.

Each variant's least capacity is found by bisection, with nothing cached at the stage's
start and from 999 random cached layouts (freed blocks of 1/4 u to 5 u); the least over
all of them is what the most favourable history could give. Without parameters, stem or
context, so the totals are below the engine's. Results in
``results/convnext_stage0_sim.md``:

    cd benchmarks && python convnext_stage0_sim.py
"""

from __future__ import annotations

import random
from pathlib import Path

U = 1296  # MiB: one fp16 activation of convnext_tiny's stage 0 at 768 x 384 px
OUT = Path(__file__).resolve().parent / "results" / "convnext_stage0_sim.md"


class Sim:
    """Segments as lists of [size, owner] blocks (owner None: free), in address order."""

    def __init__(self, capacity: int):
        self.capacity, self.segments = capacity, []

    def reserved(self) -> int:
        return sum(size for segment in self.segments for size, _ in segment)

    def malloc(self, owner: str, size: int) -> None:
        free = [(block[0], s, b) for s, segment in enumerate(self.segments)
                for b, block in enumerate(segment) if block[1] is None and block[0] >= size]
        if not free:
            if self.reserved() + size > self.capacity:
                self.empty_cache()
                if self.reserved() + size > self.capacity:
                    raise MemoryError(owner)
            self.segments.append([[size, owner]])
            return
        _, s, b = min(free)  # smallest, then lowest address
        segment = self.segments[s]
        block = segment[b]
        if block[0] - size > 1:  # split: more than 1 MiB (kSmallSize) would remain
            segment.insert(b + 1, [block[0] - size, None])
            block[0] = size
        block[1] = owner

    def empty_cache(self) -> None:
        """Release every wholly free segment (``release_cached_blocks``, ``emptyCache``)."""
        self.segments = [g for g in self.segments if not (len(g) == 1 and g[0][1] is None)]

    def free(self, owner: str) -> None:
        for segment in self.segments:
            for b, block in enumerate(segment):
                if block[1] == owner:
                    block[1] = None
                    if b + 1 < len(segment) and segment[b + 1][1] is None:
                        block[0] += segment.pop(b + 1)[0]
                    if b > 0 and segment[b - 1][1] is None:
                        segment[b - 1][0] += segment.pop(b)[0]
                    return
        raise KeyError(owner)


def stage0(capacity: int, start: list[int], variant: str, blocks: int = 3) -> None:
    sim = Sim(capacity)
    sim.malloc("image", U)
    for i, size in enumerate(start):  # whatever is cached when the stage starts
        sim.malloc(f"x{i}", size)
    residual = U if variant == "fp16 residual stream" else 2 * U
    sim.malloc("S", 2 * U)
    for i in range(len(start)):
        sim.free(f"x{i}")
    previous = "S"
    for k in range(blocks):
        sim.malloc("c", U), sim.malloc("d", U), sim.free("c")
        if k == 0:  # the depthwise convolution's cuDNN search: emptyCache
            sim.empty_cache()
        if variant != "no LayerNorm input copy":
            sim.malloc("q", 2 * U)
        sim.malloc("n", U if variant == "fp16 LayerNorm output" else 2 * U)
        if variant != "no LayerNorm input copy":
            sim.free("q")
        sim.free("d")
        sim.malloc("f", U), sim.malloc("h", 4 * U), sim.free("f")
        sim.malloc("g", 4 * U), sim.free("h")
        sim.malloc("o", U), sim.free("g"), sim.free("n")
        sim.malloc("m", residual), sim.free("o")
        sim.malloc(f"a{k}", residual), sim.free("m")
        if previous != "S":
            sim.free(previous)
        previous = f"a{k}"


def least_capacity(start: list[int], variant: str) -> int:
    low, high = 0, 64 * U
    while high - low > 2:
        mid = (low + high) // 2
        try:
            stage0(mid, start, variant)
            high = mid
        except MemoryError:
            low = mid
    return high


def main() -> None:
    rng = random.Random(0)
    starts = [[]] + [[rng.choice([U // 4, U // 2, U, 3 * U // 2, 2 * U, 3 * U, 4 * U, 5 * U])
                      for _ in range(rng.randint(1, 5))] for _ in range(999)]
    variants = ["as traced", "no LayerNorm input copy", "fp16 LayerNorm output",
                "fp16 residual stream"]
    header = ("| variant | least capacity, nothing cached (MiB) | the least of 1,000 cached "
              "layouts at the stage's start (MiB) |")
    lines = [header, "|---|---|---|"]
    for variant in variants:
        needs = [least_capacity(start, variant) for start in starts]
        lines.append(f"| {variant} | {needs[0]:,} | {min(needs):,} |")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
