"""The largest micro-batch that fits, from as few traces as the answer allows: a search over
the divisors of the per-replica batch that keeps a bisection's bracket and probes where the
line through known needs meets the budget (:func:`divisor_search`, a generator, so that
``plan`` can drive every layout's search at once; :func:`largest_fitting_divisor` drives
it with plain callables).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence


def largest_fitting_divisor(divisors: Sequence[int], need: Callable[[int], int],
                            budget: int, slope: float | None = None,
                            need_two: Callable[[list[int]], dict[int, int]] | None = None,
                            known: Mapping[int, int] | None = None) -> int | None:
    """The largest of the increasing ``divisors`` whose ``need`` fits ``budget`` (None when
    the first does not), given that ``need`` grows with the micro-batch; ``need`` is one
    trace, so it is asked as few times as the answer allows (:func:`divisor_search`, which
    this drives: ``need_two`` asks two needs at once, e.g. a pool with a worker; ``known``:
    needs traced before, micro-batch -> bytes, not asked again).

    Example:
        >>> asked = []
        >>> need = lambda b: asked.append(b) or 10 + 3 * b
        >>> largest_fitting_divisor([1, 2, 4, 8, 16, 32, 64, 128], need, 60), asked
        (16, [1, 2, 16, 32])
    """
    search = divisor_search(divisors, budget, lambda: slope, need_two is not None, known)
    try:
        asked = next(search)
        while True:
            got = need_two(asked) if len(asked) == 2 and need_two is not None else \
                {b: need(b) for b in asked}
            asked = search.send(got)
    except StopIteration as stop:
        return stop.value


def divisor_search(divisors: Sequence[int], budget: int,
                   slope: Callable[[], float | None] = lambda: None, pairs: bool = False,
                   known: Mapping[int, int] | None = None
                   ) -> Generator[list[int], dict[int, int], int | None]:
    """The search of :func:`largest_fitting_divisor` as a generator: it yields the
    micro-batches it needs traced next (one; two with ``pairs``), is sent their needs
    (``{micro-batch: bytes}``), and returns the answer.

    Keeps a bracket, as a bisection over the divisors does (``divisors[low]`` fits,
    ``divisors[high]`` does not, or ``high`` is past the end) and returns ``divisors[low]``
    once ``high = low + 1``: the bisection's answer. It probes where the line through two
    known needs meets the budget, since memory is nearly affine in the micro-batch: the
    first divisor (nothing fits: one trace, where a bisection over 8 divisors takes three),
    the second (a line through two needs, or the answer 1: two traces), the largest divisor
    the line fits, then its neighbour above to confirm it (four traces, or three when the
    line fits them all). Given a ``slope()`` (bytes per sample, e.g. measured on another
    layout; asked when the search has one need only), the line through the first need
    with that slope is the first guess: three traces when it is right.

    With ``pairs`` it asks two at a time: the second and third divisors (a micro-batch of
    2 that fits and 4 that does not settle it in one round; where 2 does not fit, the
    first is traced next), then each probe with the neighbour that settles the bracket if
    the line is right (above it, or below it when the one above is known to fail); a
    probe the line already says does not fit goes alone (the answer is then the bracket's
    low end, whatever a partner would show). The answer is the same; a line that is right
    takes two rounds.
    """
    index = {b: i for i, b in enumerate(divisors)}
    known = {index[b]: n for b, n in (known or {}).items() if b in index}

    def ask(*indices: int) -> Generator[list[int], dict[int, int], None]:
        todo = [i for i in dict.fromkeys(indices) if i not in known and i < len(divisors)]
        for group in [todo] if pairs else [[i] for i in todo]:
            if group:
                got = yield [divisors[i] for i in group]
                known.update((i, got[divisors[i]]) for i in group)

    if not known:
        # in pairs, the second and third divisors: where the answer is 2 (a large model
        # on its card) that settles it, and a line through moderate micro-batches, where
        # per-sample tensors already outweigh the fixed ones, extrapolates better
        yield from (ask(1, 2) if pairs and len(divisors) > 2 else ask(0, 1) if pairs
                    else ask(0))
    while True:
        high = min((i for i, n in known.items() if n > budget), default=len(divisors))
        if high == 0:
            return None
        # -1: nothing known to fit yet (every need traced is over the budget)
        low = max((i for i, n in known.items() if n <= budget and i < high), default=-1)
        if high - low <= 1:
            return divisors[low]
        probe, fits = _probe(divisors, known, low, high, budget, slope())
        partner = probe + 1 if probe + 1 < high else probe - 1
        yield from (ask(probe, partner) if pairs and partner > low and fits is not False
                    else ask(probe))


def _probe(divisors: Sequence[int], known: dict[int, int], low: int, high: int,
           budget: int, slope: float | None = None) -> tuple[int, bool | None]:
    """The index strictly inside ``(low, high)`` to trace next: the largest divisor the line
    through ``low``'s need (``high``'s when ``low`` is -1: nothing known fits) and the
    nearest other known need (or, with no other yet, of ``slope``) fits (``low + 1`` when
    the line fits none, or there is no line; ``high - 1`` when memory does not grow), and
    whether the line says it fits (None: no line)."""
    base = low if low >= 0 else high
    others = [i for i in known if i != base]
    x0, y0 = divisors[base], known[base]
    if others:
        other = min(others, key=lambda i: abs(i - base))
        x1, y1 = divisors[other], known[other]
        if y1 == y0 or (y1 - y0) * (x1 - x0) < 0:
            return high - 1, True
        slope = (y1 - y0) / (x1 - x0)
    elif not slope or slope <= 0:
        return low + 1, None
    crossing = x0 + (budget - y0) / slope
    fitting = [i for i in range(low + 1, high) if divisors[i] <= crossing]
    return (fitting[-1], True) if fitting else (low + 1, False)
