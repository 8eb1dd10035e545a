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

A bf16 base (on CUDA; LoRA and optimizer stay fp32) sums inside every matmul in fp32, as
cuBLAS and oneDNN do, but stores each op's result in bf16, rounding it to 8 significant bits
(u = 2⁻⁸). Two evaluations whose sums differ by fp32 rounding (a GEMM blocked differently for
a taller packed matrix, a split-K chosen by shape) may then round any stored result along the
chain one way or the other, and every rounding is within u·|value|. So the same rule applies
with the bf16 unit roundoff and, as the length, the number of bf16 *roundings* along the chain
(`model_roundings`), on top of the fp32 rule for the sums themselves. It is far looser (a
4-layer model: ~40% of the magnitude), as worst-case bounds in 8 bits are; tests that use it
also check that what they guard against moves the result by more than it.
"""

from __future__ import annotations

import torch

U32 = 2.0 ** -24  # fp32 unit roundoff
U16 = 2.0 ** -8  # bf16 unit roundoff (8 significant bits)


def fp32_tolerance(magnitude: float, terms: int) -> float:
    """Largest difference two fp32 orders of a sum of `terms` terms of size `magnitude` may show."""
    return 2.0 * terms * U32 * max(1.0, float(magnitude))


def bf16_tolerance(magnitude: float, terms: int, roundings: int) -> float:
    """Largest difference two evaluations over a bf16 base may show: `roundings` results stored in
    bf16 along the chain, each rounded either way (2·R·u16·magnitude), plus the fp32 rule for
    sums of `terms` terms."""
    return fp32_tolerance(magnitude, terms) + 2.0 * roundings * U16 * max(1.0, float(magnitude))


def model_roundings(config) -> int:
    """bf16 roundings along the chain behind one logit (the backward's chain is as long).

    Per layer, the results stored in the base's dtype: input norm, q/k/v projection, rotary
    embedding, attention, o projection, residual add, post-attention norm, gate/up projection,
    activation, its product with up, down projection, residual add (12); then the final norm
    and the head. (LoRA deltas are fp32 and added before the one rounding of their layer.)
    """
    return 12 * config.num_hidden_layers + 2


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


def tolerance(magnitude: float, terms: int, base_dtype: torch.dtype = torch.float32, roundings: int = 0) -> float:
    """fp32_tolerance for an fp32 base; bf16_tolerance (with `roundings`) for a bf16 one."""
    if base_dtype == torch.bfloat16:
        return bf16_tolerance(magnitude, terms, roundings)
    if base_dtype != torch.float32:
        raise ValueError(f"no rounding rule for a {base_dtype} base")
    return fp32_tolerance(magnitude, terms)


def assert_fp32_close(actual, expected, terms: int, what: str = "", magnitude: float | None = None) -> None:
    """|actual − expected| ≤ fp32_tolerance(max |expected|, terms), elementwise."""
    assert_close(actual, expected, terms, what, magnitude)


def assert_close(actual, expected, terms: int, what: str = "", magnitude: float | None = None,
                 base_dtype: torch.dtype = torch.float32, roundings: int = 0) -> None:
    """|actual − expected| ≤ tolerance(max |expected|, terms, ...), elementwise: the fp32 rule,
    or over a bf16 base (`base_dtype`) the bf16 rule with `roundings`."""
    actual = torch.as_tensor(actual).detach().to("cpu", torch.float64)  # (either may live on a GPU)
    expected = torch.as_tensor(expected).detach().to("cpu", torch.float64)
    assert actual.shape == expected.shape, f"{what}: shapes {tuple(actual.shape)} vs {tuple(expected.shape)}"
    if magnitude is None:
        magnitude = float(expected.abs().max()) if expected.numel() else 0.0
    tol = tolerance(magnitude, terms, base_dtype, roundings)
    diff = float((actual - expected).abs().max()) if actual.numel() else 0.0
    rule = "fp32 rounding" if base_dtype == torch.float32 else f"rounding over a bf16 base ({roundings} roundings)"
    assert diff <= tol, f"{what}: differs by {diff:.3g}, more than {rule} allows ({tol:.3g}; " \
                        f"magnitude {magnitude:.3g}, {terms} accumulated terms)"
