"""Text to Datum, and a small built-in task whose progress is easy to see and to score.

The task is generated, not downloaded: two-digit additions written as
``"12+34=46\\n"``. The prompt (``"12+34="``) carries weight 0, the answer weight 1,
so the loss measures exactly what a reward function can check.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence

from .types import Datum, ModelInput


def datum_from_tokens(prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> Datum:
    """Next-token Datum: position i predicts token i+1; only completion tokens are weighted."""
    tokens = list(prompt_tokens) + list(completion_tokens)
    if len(tokens) < 2:
        raise ValueError("a datum needs at least two tokens (prompt + completion)")
    weights = [0.0] * len(prompt_tokens) + [1.0] * len(completion_tokens)
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                 loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]})


def datum_from_text(tokenizer, prompt: str, completion: str) -> Datum:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    completion_ids = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
    return datum_from_tokens(prompt_ids, completion_ids)


def addition_problem(rng: random.Random, digits: int = 2) -> tuple[str, str]:
    hi = 10 ** digits - 1
    a, b = rng.randint(0, hi), rng.randint(0, hi)
    return f"{a}+{b}=", f"{a + b}"


def score_addition(prompt: str, completion: str) -> float:
    """1.0 if the completion starts with the right sum, else 0.0 (a programmatic reward)."""
    a, b = prompt.rstrip("=").split("+")
    leading = re.match(r"\d+", completion.strip())
    return 1.0 if leading is not None and leading.group() == str(int(a) + int(b)) else 0.0


def addition_batches(tokenizer, batch_size: int = 8, seed: int = 0, digits: int = 2) -> Iterator[list[Datum]]:
    """An endless stream of batches of the addition task, the same for the same seed."""
    rng = random.Random(seed)
    while True:
        yield [datum_from_text(tokenizer, *addition_problem(rng, digits)) for _ in range(batch_size)]


def text_batches(tokenizer, text: str, seq_len: int = 64, batch_size: int = 4, seed: int = 0) -> Iterator[list[Datum]]:
    """Random windows of a text, for plain language-model training."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < seq_len + 1:
        raise ValueError(f"the text has {len(ids)} tokens; need at least seq_len + 1 = {seq_len + 1}")
    rng = random.Random(seed)
    while True:
        batch = []
        for _ in range(batch_size):
            start = rng.randrange(0, len(ids) - seq_len)
            window = ids[start:start + seq_len + 1]
            batch.append(Datum(model_input=ModelInput.from_ints(window[:-1]),
                               loss_fn_inputs={"target_tokens": window[1:]}))
        yield batch
