"""The ring-attention exercise of notebook 12: merging two blocks' attention outputs by their log-sum-exps,
checked on cases whose scores leave float32's and float64's range.

Example: ``softmax_merge(fn)``, where ``fn(out1, lse1, out2, lse2)`` returns the merged ``(out, lse)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtlib.checks.feedback import Feedback


def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5 + offset
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse


def _merge_case(sizes: Sequence[int], offsets: Sequence[float]
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Queries, keys in blocks of ``sizes``, block i's scores raised by ``offsets[i]``: the full attention (float64),
    each block's (out, lse) in float32, and the full attention's lse (float64). Offsets of about 1000 make
    exp(lse) overflow float64 (past 709) and offsets of -1000 underflow it to 0: only a merge that exponentiates
    differences of lse survives them."""
    generator = torch.Generator().manual_seed(12)
    q = torch.randn(2, 4, 8, generator=generator, dtype=torch.float64)
    k = torch.randn(2, sum(sizes), 8, generator=generator, dtype=torch.float64)
    v = torch.randn(2, sum(sizes), 8, generator=generator, dtype=torch.float64)
    blocks = [_block_attention(q, k_i, v_i, offset) for k_i, v_i, offset in
              zip(k.split(list(sizes), 1), v.split(list(sizes), 1), offsets, strict=True)]
    bias = torch.cat([torch.full((size,), float(offset), dtype=torch.float64)
                      for size, offset in zip(sizes, offsets, strict=True)])
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5 + bias
    full = torch.softmax(scores, dim=-1) @ v
    return full, [(out.float(), lse.float()) for out, lse in blocks], torch.logsumexp(scores, dim=-1, keepdim=True)


#: (block sizes, score offsets, what the case is, atol), for the output and the lse alike: float32's lse near 1000
#: is exact to 6e-5 only (a right float32 merge is then off by 4e-5), so the cases of large scores compare to 2e-4.
#: Where one block's scores are 1000 above another's, its output alone is the merged output to float32's
#: precision, so only the lse shows a merge that bounds the difference of lses (a clamp): the chain of three
#: after it passes that lse on.
MERGE_CASES = (((8, 8), (0, 0), "two equal blocks", 1e-5),
               ((3, 13), (0, 0), "a block of 3 keys and one of 13", 1e-5),
               ((4, 5, 7), (0, 0, 0), "three blocks merged in a chain", 1e-5),
               ((8, 8), (1000, 1000), "scores near 1000 (lse about 1000: exp(lse) overflows float64 too)", 2e-4),
               ((8, 8), (-1000, -1000), "scores near -1000 (exp(lse) underflows to 0, in float64 too)", 2e-4),
               ((8, 8), (0, 1000), "one block's scores 1000 above the other's", 2e-4),
               ((4, 5, 7), (0, 1000, 1000), "three blocks in a chain, the last two's scores 1000 above the first's",
                2e-4))


def _overflowed(what: str, offsets: Sequence[float], largest: float, which: str) -> str:
    if len(set(offsets)) == 1:
        did = (f"your merge exponentiated a number of about {largest:.0f} in size, such as lse itself: exp overflows "
               "past 709 and underflows to 0 below -745 even in float64 (past 88 and below -103 in float32), and 0/0 "
               "is nan, so no dtype saves exp(lse1) and exp(lse2)")
    else:
        did = ("your merge exponentiated a number of about 1000, such as one block's lse relative to the other's, "
               "exp(lse2 - lse1): that overflows even float64 (past 709; float32 past 88)")
    return (f"With {what}, your merged {which} holds inf or nan: {did}. Weigh each block by exp(lse_i - lse), with "
            "lse = torch.logaddexp(lse1, lse2): the exponents are never positive, so nothing overflows.")


def softmax_merge(fn: Callable[..., Any]) -> Feedback:
    """Notebook 12: ``fn(out1, lse1, out2, lse2)`` merges two blocks' attention, each normalised over its own keys
    with its log-sum-exp, into the attention over both blocks' keys, and returns ``(out, lse)``.

    Checked against full attention (:data:`MERGE_CASES`): two equal blocks, two unequal ones, three blocks merged
    in a chain (which needs the merged lse right, not only the output), and scores whose exponentials overflow
    and underflow float64, so that only a merge that exponentiates differences of lse passes. The merged lse is
    compared with full attention's in every case, as the output is.
    """
    if not callable(fn):
        return Feedback(False, f"Pass your function itself, not {type(fn).__name__}.")
    for sizes, offsets, what, atol in MERGE_CASES:
        expected, blocks, expected_lse = _merge_case(sizes, offsets)
        out, lse = blocks[0]
        try:
            for out_i, lse_i in blocks[1:]:
                merged = fn(out.clone(), lse.clone(), out_i.clone(), lse_i.clone())  # edits in place stay the answer's
                if not (isinstance(merged, tuple | list) and len(merged) == 2):
                    got = f"{len(merged)} values" if isinstance(merged, tuple | list) else type(merged).__name__
                    return Feedback(False, f"Return (out, lse), two tensors; your merge returned {got}.")
                out, lse = merged
        except Exception as exc:  # noqa: BLE001 - the learner's code: say what it raised
            return Feedback(False, f"With {what}, your merge raised {type(exc).__name__}: {exc}")
        if not isinstance(out, torch.Tensor):
            return Feedback(False, f"With {what}, the merged output should be a torch tensor, got "
                                   f"{type(out).__name__}.")
        if out.shape != expected.shape:
            return Feedback(False, f"With {what}, the merged output should have shape {tuple(expected.shape)}, got "
                                   f"{tuple(out.shape)}.")
        if not isinstance(lse, torch.Tensor) or lse.shape != blocks[0][1].shape:
            return Feedback(False, f"With {what}, the merged lse should be a tensor of shape "
                                   f"{tuple(blocks[0][1].shape)}, like each block's (one number per query row), got "
                                   f"{tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__}.")
        low = next((f"{name} as {str(t.dtype).removeprefix('torch.')}" for name, t in (("output", out), ("lse", lse))
                    if not t.is_floating_point() or torch.finfo(t.dtype).bits < 32), None)
        if low is not None:
            return Feedback(False, f"With {what}, you returned the merged {low}: the blocks come in float32 and their "
                                   "merge is exact in it; return float32 (or float64), or the rounding, not the "
                                   "merge, decides what the next merge sees.")
        largest = max(float(block_lse.abs().max()) for _, block_lse in blocks)
        out = out.detach().to(torch.float64)  # any float dtype the learner computed in
        if not torch.isfinite(out).all():
            return Feedback(False, _overflowed(what, offsets, largest, "output"))
        if not torch.isfinite(lse.detach()).all():
            return Feedback(False, _overflowed(what, offsets, largest, "lse"))
        if torch.allclose(out, expected, atol=atol):
            off = float((lse.detach().to(torch.float64) - expected_lse).abs().max())
            if off <= atol:
                continue
            return Feedback(False, f"With {what}, your output is right but your lse is off by up to {off:.3g}: the "
                                   "merged lse is the log-sum-exp over both blocks' keys, torch.logaddexp(lse1, lse2), "
                                   "and the next block is weighed by it, so with it wrong three in a chain do not "
                                   "merge right.")
        if len(sizes) == 2 and torch.allclose(out, ((blocks[0][0] + blocks[1][0]) / 2).double(), atol=atol):
            return Feedback(False, f"With {what}, you averaged the two outputs: each block's output is normalised over "
                                   "its own keys only; weigh it by its share of the whole softmax's mass, "
                                   "exp(lse_i - lse).")
        if len(sizes) == 3:
            return Feedback(False, "Two blocks merge right, but three in a chain do not: the lse you return must be "
                                   "the log-sum-exp over both blocks' keys, torch.logaddexp(lse1, lse2), so that "
                                   "the next merge weighs the merged block correctly.")
        return Feedback(False, f"With {what}, your output differs from full attention by up to "
                               f"{(out - expected).abs().max().item():.3g}: weigh block i by exp(lse_i - lse), where "
                               "lse = torch.logaddexp(lse1, lse2).")
    return Feedback(True, "Equal blocks, unequal ones, a chain of three and scores whose exp overflows and underflows "
                          "float64 (lse near 1000 and -1000) all give full attention: out = exp(lse1 - lse) out1 + "
                          "exp(lse2 - lse) out2 with lse = logaddexp(lse1, lse2), the merge that ring attention (and "
                          "FlashAttention) run on each block.")
