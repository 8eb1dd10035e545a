"""Tolerances for comparing two fp32 evaluations of the same quantity.

Two evaluations that add the same numbers in a different order (packed vs solo rows,
micro-batches, another thread count, another CPU's vector width, PEFT's kernels vs ours)
differ by rounding, and only by rounding. A sum of n terms evaluated in fp32 in any order
is within n·u·Σ|terms| of the exact sum (u = 2⁻²⁴, the unit roundoff; Higham, *Accuracy and
Stability of Numerical Algorithms*, §4.2), so two orders differ by at most 2·n·u·Σ|terms|.

We apply that bound with
* n, the *accumulation length*: the longest chain of sums behind one compared value (for a
  pass over a model, the sum of the inner dimensions it goes through, see `model_terms`);
* Σ|terms| bounded by the *magnitude* of what is compared: the largest absolute value in
  the compared tensor (at least 1: logits, log-probabilities and losses are O(1) and their
  intermediate terms are too, even where a result cancels to near zero).

This is a worst-case bound, far above the error any CPU shows (typically √n·u), yet orders
of magnitude below what a real bug does: a neighbour's LoRA scale moved log-probabilities by
nats, a lost datum moves a gradient by 1/batch. Never tighten a tolerance to what one
machine happened to show: CI runs on other CPUs.
"""

from __future__ import annotations

import torch

U32 = 2.0 ** -24  # fp32 unit roundoff


def fp32_tolerance(magnitude: float, terms: int) -> float:
    """Largest difference two fp32 orders of a sum of `terms` terms of size `magnitude` may show."""
    return 2.0 * terms * U32 * max(1.0, float(magnitude))


def model_terms(config, seq_len: int, batch_tokens: int = 0) -> int:
    """Accumulation length behind one logit of a decoder pass (and, with `batch_tokens`, one
    LoRA gradient entry, whose backward also sums over every token of the batch).

    Per layer: q/k/v projections (hidden), attention over at most `seq_len` keys, the output
    projection (hidden), the MLP's gate/up (hidden) and down (intermediate), each LoRA path
    (rank ≤ hidden); then the head (hidden) and the log-softmax (vocabulary). The backward
    runs the same chain in reverse, so its length is the same up to the batch sum.
    """
    hidden, inter = config.hidden_size, config.intermediate_size
    per_layer = 3 * hidden + seq_len + hidden + 2 * hidden + inter
    return config.num_hidden_layers * per_layer + hidden + config.vocab_size + batch_tokens


def tiny_config():
    """The built-in model's config (DEFAULT_MODEL)."""
    from trio_widgets.engine.models import _tiny_llama_config

    return _tiny_llama_config()


def assert_fp32_close(actual, expected, terms: int, what: str = "", magnitude: float | None = None) -> None:
    """|actual − expected| ≤ fp32_tolerance(max |expected|, terms), elementwise."""
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, f"{what}: shapes {tuple(actual.shape)} vs {tuple(expected.shape)}"
    if magnitude is None:
        magnitude = float(expected.abs().max()) if expected.numel() else 0.0
    tol = fp32_tolerance(magnitude, terms)
    diff = float((actual - expected).abs().max()) if actual.numel() else 0.0
    assert diff <= tol, f"{what}: differs by {diff:.3g}, more than fp32 rounding allows ({tol:.3g}; " \
                        f"magnitude {magnitude:.3g}, {terms} accumulated terms)"
