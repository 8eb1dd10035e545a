"""A tiny RL loop: importance-sampling updates on a programmatic reward.

The policy is a LoRA on the built-in tiny byte-level Llama. The reward of a sampled
completion is the fraction of its bytes that are lowercase ASCII letters (about 10%
for the random-init model). Each update:

1. `save_weights_and_get_sampling_client()` freezes the current weights for sampling;
2. `sample` draws a group of completions of one prompt (with their logprobs);
3. advantages are the rewards minus the group's mean;
4. `forward_backward(..., "importance_sampling")` + `optim_step` raise the probability
   of the better-than-average completions.

Run it: ``python examples/rl_importance_sampling.py`` (prints the mean reward per update).
The same loop runs on a hosted Tinker-style service after changing the import.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import trio_widgets as trio

PROMPT = "Write something: "


def reward(tokens: list[int]) -> float:
    """Fraction of the completion's bytes that are a-z (byte tokenizer: token = byte + 3)."""
    if not tokens:
        return 0.0
    return sum(1 for t in tokens if ord("a") <= t - 3 <= ord("z")) / len(tokens)


def rl_datum(prompt: list[int], completion: list[int], logprobs: list[float], advantage: float) -> trio.Datum:
    tokens = prompt + completion
    n_prompt = len(prompt) - 1  # targets that are prompt tokens: no loss there
    return trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n_prompt + list(logprobs),
            "advantages": [0.0] * n_prompt + [advantage] * len(completion),
        },
    )


def train(service: trio.ServiceClient, updates: int = 12, group_size: int = 16, max_tokens: int = 8,
          learning_rate: float = 3e-2, rank: int = 8, seed: int = 0,
          on_update: Callable[[int, float], None] | None = None) -> list[float]:
    """Run `updates` RL updates; returns the mean reward of the samples of each update."""
    tc = service.create_lora_training_client(trio.DEFAULT_MODEL, rank=rank, seed=seed,
                                             user_metadata={"name": "rl-importance-sampling"})
    prompt = tc.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    params = trio.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    means = []
    for step in range(updates):
        sampler = tc.save_weights_and_get_sampling_client()
        params.seed = seed * 100_003 + step
        result = sampler.sample(trio.ModelInput.from_ints(prompt), group_size, params).result()
        rewards = [reward(s.tokens) for s in result.sequences]
        mean = sum(rewards) / len(rewards)
        means.append(mean)
        if on_update is not None:
            on_update(step, mean)
        data = [rl_datum(prompt, s.tokens, s.logprobs, r - mean)
                for s, r in zip(result.sequences, rewards) if r != mean]
        if data:
            tc.forward_backward(data, "importance_sampling")
            tc.optim_step(trio.AdamParams(learning_rate=learning_rate)).result()
    return means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with trio.LocalPool(min_cycle_s=0.002) as pool:
        train(trio.ServiceClient(pool), updates=args.updates, group_size=args.group_size, seed=args.seed,
              on_update=lambda step, mean: print(f"update {step:3d}  mean reward {mean:.3f}", flush=True))


if __name__ == "__main__":
    main()
