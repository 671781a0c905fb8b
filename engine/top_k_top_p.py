"""Top-k and top-p (nucleus) truncation of tempered logits, in torch: the
sampler's path for the rows its C++ operator does not take (a GPU, or rows
with bias, bans, penalties or a grammar; `engine/sampling.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine.device_lists import index, on_device

log = logging.getLogger(__name__)

# Candidates read per row, widened for the rows whose kept set may reach
# past them, before a full sort: a nucleus or a top-k list is nearly always
# far shorter than the vocabulary.
_TOP_WIDTHS = (256, 4096)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus with -inf.

    top_k: `[rows]` long (vocab size = off); top_p: `[rows]` float (1 = off).
    A token survives top-k if its logit is at least the k-th largest (ties
    kept), then top-p if the mass of the surviving tokens with larger logits
    is below `top_p` (the most likely token always survives, and equal
    logits survive together).

    Each row is first cut to its 256 largest logits (`topk`, not a sort of
    the vocabulary: a full sort of 32 rows of a 49k vocabulary cost ~180 ms
    on a CPU core); a row whose kept set might reach past them (a flat
    distribution, a large k, ties at the edge) is cut to 4,096, then sorted
    in full.
    """
    active = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    if top_k is not None:
        active |= top_k < logits.shape[-1]
    if top_p is not None:
        active |= top_p < 1.0
    out = logits.clone()
    rows = active.nonzero().squeeze(1)
    for width in _TOP_WIDTHS:
        if not rows.numel():
            return out
        cut, fits = _top_k_top_p_candidates(
            logits[rows], None if top_k is None else top_k[rows],
            None if top_p is None else top_p[rows], width)
        out[rows[fits]] = cut[fits]
        rows = rows[~fits]
    if rows.numel():
        out[rows] = _top_k_top_p_sorted(
            logits[rows], None if top_k is None else top_k[rows],
            None if top_p is None else top_p[rows])
    return out


def top_k_top_p_without_waiting(
    logits: torch.Tensor, top_k: Sequence[int] | None, top_p: Sequence[float] | None,
) -> torch.Tensor:
    """`apply_top_k_top_p` with nothing read back to the host, from each
    row's `top_k` and `top_p` as the host holds them (vocab size or more /
    1.0 = off).

    The candidate cut above decides on the device which rows need a wider
    cut or a sort, and acting on that decision reads it back: on a GPU
    under async scheduling the host would wait for the pass in flight
    (`scheduler/ahead.py`).  Here the host decides from the parameters
    alone: a row with top-k only takes the `max k` largest logits
    (`topk`) and keeps what reaches its k-th (ties kept); a row with top-p,
    or with a k too large for `topk` to beat a sort, is sorted in full, as
    vLLM's torch sampler does (or, with `SEARCH_ON_CUDA`, cut at thresholds
    found by a search over its logits, `engine/top_k_top_p_triton.py`); both
    keep every token tied with the nucleus's edge, so that the kept set does
    not depend on the order a sort leaves equal logits in (a GPU's sort is
    not stable).  On a CPU this function serves only tests: the sampler
    takes the candidate cut there."""
    rows, vocab = logits.shape
    ks = [vocab if k >= vocab else max(k, 1) for k in top_k or [vocab] * rows]
    ps = list(top_p or [1.0] * rows)
    out = logits.clone()
    # k past the widest candidate cut: a sort costs about as much.
    by_k = [i for i in range(rows) if ks[i] <= _TOP_WIDTHS[-1] and ks[i] < vocab
            and ps[i] >= 1.0]
    by_sort = [i for i in range(rows) if ps[i] < 1.0 or _TOP_WIDTHS[-1] < ks[i] < vocab]
    dev = logits.device
    if by_k:
        at = index(by_k, dev)
        cut = logits.index_select(0, at)
        top = cut.topk(max(ks[i] for i in by_k), dim=-1).values
        kth = top.gather(1, on_device([ks[i] - 1 for i in by_k], torch.long, dev).unsqueeze(1))
        out.index_copy_(0, at, cut.masked_fill_(cut < kth, float("-inf")))
    if by_sort:
        at = index(by_sort, dev)
        cut = _searched_or_sorted(
            logits.index_select(0, at),
            on_device([ks[i] for i in by_sort], torch.long, dev),
            on_device([ps[i] for i in by_sort], torch.float32, dev))
        out.index_copy_(0, at, cut)
    return out


# Whether a GPU's rows take the threshold search instead of the sort.  Off
# until measured: it runs one program a row over a few reads of it, so a
# small batch may wait on a few multiprocessors' latency where a segmented
# sort spreads a row over many (`bench.sampling_bench --device cuda`: cut_ms
# against cut_sorted_ms decides, and from how many rows).
SEARCH_ON_CUDA = False
_search_failed = False


def _searched_or_sorted(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    search: bool | None = None,
) -> torch.Tensor:
    """The rows' cut by the threshold search (`engine/top_k_top_p_triton.py`;
    by default where `SEARCH_ON_CUDA` and the rows are on a GPU), else by a
    sort; a search that fails to build or launch is reported once and sorted
    from then on."""
    global _search_failed
    if search is None:
        search = SEARCH_ON_CUDA and logits.is_cuda
    if search and not _search_failed:
        try:
            from engine.top_k_top_p_triton import top_k_top_p_searched
            return top_k_top_p_searched(logits, top_k, top_p)
        except Exception as e:  # a Triton build or launch failure
            _search_failed = True
            log.warning("top-k/top-p threshold search unavailable (%s: %s); sorting instead",
                        type(e).__name__, e)
    return _top_k_top_p_sorted(logits, top_k, top_p)


def _top_k_top_p_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_top_k_top_p` over each row's `width` largest logits, and
    whether each row's kept set surely lies among them."""
    rows, vocab = logits.shape
    width = min(vocab, width)
    vals, idx = logits.topk(width, dim=-1)  # descending
    keep = torch.ones_like(vals, dtype=torch.bool)
    fits = torch.ones(rows, dtype=torch.bool, device=logits.device)
    k_on = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    if top_k is not None:
        k = top_k.clamp(1, vocab)
        k_on = k < vocab
        kth = vals.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))
        keep &= ~k_on.unsqueeze(1) | (vals >= kth)
        # k past the candidates, or ties with the k-th running past them.
        fits &= ~k_on | ((k <= width) & ((vals[:, -1] < kth.squeeze(1)) | (width == vocab)))
    if top_p is not None:
        p_on = top_p < 1.0
        kept_vals = vals.masked_fill(~keep, float("-inf"))
        # Normaliser: the kept candidates under top-k, else the whole row.
        log_z = torch.where(k_on, kept_vals.logsumexp(dim=-1), logits.logsumexp(dim=-1))
        mass = (kept_vals - log_z.unsqueeze(1)).exp()
        before = mass.cumsum(dim=-1) - mass
        nucleus = before < top_p.unsqueeze(1)
        nucleus[:, 0] = True
        # Every candidate tied with the nucleus's last stays too, as in the
        # sort's cut, whatever order `topk` left equal logits in.
        edge = vals.gather(1, (nucleus & keep).sum(dim=-1, keepdim=True) - 1)
        keep &= ~p_on.unsqueeze(1) | (vals >= edge)
        # Without top-k, the nucleus ends inside the candidates only if
        # their mass reaches top_p; and its ties must not run past them.
        fits &= ~p_on | (width == vocab) | (
            (k_on | (mass.sum(dim=-1) >= top_p)) & (vals[:, -1] < edge.squeeze(1)))
    out = torch.full_like(logits, float("-inf")).scatter_(
        -1, idx, vals.masked_fill(~keep, float("-inf")))
    return out, fits


def _top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """`apply_top_k_top_p` by a full sort of each row (the general case):
    each cut is the sorted row's value at its edge, and the row keeps what
    reaches it (ties kept), so nothing is scattered back."""
    vocab = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1).values  # ascending
    edge = torch.full_like(sorted_logits[:, :1], float("-inf"))
    if top_k is not None:
        edge = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < edge, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # The running sum rises along the row: the tokens it leaves at or
        # under 1 - top_p come first (those top-k cut among them: they weigh
        # 0); the most likely token always survives.
        dropped = (cum <= (1.0 - top_p).unsqueeze(1)).sum(dim=-1).clamp_(max=vocab - 1)
        edge = sorted_logits.gather(1, dropped.unsqueeze(1))
    return logits.masked_fill(logits < edge, float("-inf"))
