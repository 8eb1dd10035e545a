"""PyTRIO-native training code after one import change (issue 32 point 6, in-process).

Each loop below is written the way pytrio 0.2.9's README and docs write theirs: `import pytrio
as trio`, `trio.ServiceClient()`, `.result()` on every op, `save_weights_and_get_sampling_client()`
used directly as the sampler, `sequence.text`, `-100` targets for the prompt. The one change is
the import line (`import trio_widgets as trio`); the built-in tiny byte-level model stands in for
the hosted one, with learning rates for its size. Each loop must learn: SFT and DPO losses fall,
the GRPO-style reward rises. (Against `serve` once the PyTRIO codec exists.)
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

import trio_widgets as trio  # was: import pytrio as trio


@pytest.fixture
def service():
    with trio.LocalPool(min_cycle_s=0.0, name="pytrio-loops") as pool:
        svc = trio.ServiceClient(pool)
        yield svc
        svc.close()


def test_sft_loop_as_pytrios_readme_writes_it(service):
    trainer = service.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=8, seed=0)
    tokenizer = trainer.get_tokenizer()
    texts = ["Question: what is Trio?\nAnswer: a model training platform.",
             "Question: what is a pool?\nAnswer: many runs on one model."]
    batch = []
    for text in texts:
        tokens = tokenizer.encode(text)
        batch.append(trio.Datum(
            model_input=trio.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        ))
    losses = []
    for _step in range(14):
        out = trainer.forward_backward(batch, "cross_entropy").result()
        trainer.optim_step(trio.AdamParams(learning_rate=3e-3)).result()
        losses.append(out.metrics["loss_mean"])
        assert out.metrics["token_count"] == sum(len(tokenizer.encode(t)) - 1 for t in texts)

    sampler = trainer.save_weights_and_get_sampling_client()
    prompt_tokens = tokenizer.encode("Question: what is Trio?\nAnswer:")
    result = sampler.sample(
        prompt=trio.ModelInput.from_ints(prompt_tokens),
        sampling_params=trio.SamplingParams(max_tokens=8, temperature=0.0),
        num_samples=1,
    ).result()
    assert isinstance(result.sequences[0].text, str) and len(result.sequences[0].tokens) == 8
    # an untrained byte model reads ~ln(259) = 5.6 nats per token; a rank-8 adapter on the tiny model
    # levels off near 2.6 within 14 steps (the last three, against a spike of one step)
    assert losses[0] > 5.0 and sum(losses[-3:]) / 3 < 0.6 * losses[0], losses


def _sequence_logprob(logprobs: torch.Tensor) -> torch.Tensor:
    """Sum of the completion's logprobs: the prompt's targets are -100, so their logprobs are 0."""
    return logprobs.sum()


def test_dpo_loop_with_minus_100_masking(service):
    """DPO the PyTRIO way: prompt targets -100 (read nothing), sequence logprobs from the
    forward's logprobs, a custom loss through forward_backward_custom, reference logprobs from
    the starting policy."""
    trainer = service.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=8, seed=0)
    tokenizer = trainer.get_tokenizer()
    pairs = [("Q: 2+2=", " 4.", " 5."), ("Q: 3+3=", " 6.", " 9."), ("Q: 1+1=", " 2.", " 7.")]

    def datum(prompt: str, completion: str) -> trio.Datum:
        prompt_tokens, completion_tokens = tokenizer.encode(prompt), tokenizer.encode(completion)
        tokens = prompt_tokens + completion_tokens
        targets = [-100] * (len(prompt_tokens) - 1) + completion_tokens  # only the completion is read
        return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": targets})

    data = [d for prompt, chosen, rejected in pairs for d in (datum(prompt, chosen), datum(prompt, rejected))]
    reference = trainer.forward(data, "cross_entropy").result()
    ref = [_sequence_logprob(torch.tensor(o["logprobs"].data)) for o in reference.loss_fn_outputs]
    n_read = sum(t != -100 for d in data for t in d.loss_fn_inputs["target_tokens"].data)
    assert reference.metrics["token_count"] == n_read  # -100 is not counted
    beta = 0.5

    def dpo_loss(data, logprobs):
        seq = [_sequence_logprob(lp) for lp in logprobs]
        margins = [beta * ((seq[i] - ref[i]) - (seq[i + 1] - ref[i + 1])) for i in range(0, len(seq), 2)]
        losses = torch.stack([-F.logsigmoid(m) for m in margins])
        accuracy = sum(float(m.detach() > 0) for m in margins) / len(margins)
        return losses.mean(), {"dpo_loss": float(losses.mean().detach()), "accuracy": accuracy}

    losses = []
    for _step in range(8):
        out = trainer.forward_backward_custom(data, dpo_loss).result()
        trainer.optim_step(trio.AdamParams(learning_rate=2e-2)).result()
        losses.append(out.metrics["dpo_loss"])
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)  # the policy is the reference at step 0
    assert losses[-1] < 0.5 * losses[0] and out.metrics["accuracy"] == 1.0, losses
    assert out.metrics["token_count"] == n_read  # the custom loss's count skips -100 too


def test_grpo_style_loop_reward_rises(service):
    """A GRPO-style loop as pytrio's README writes its rollouts: sample a group from the latest
    policy (save_weights_and_get_sampling_client, used directly), reward each sequence, advantages
    relative to the group, train with importance_sampling on the sampler's logprobs; the prompt's
    targets -100."""
    trainer = service.create_lora_training_client(base_model=trio.DEFAULT_MODEL, rank=8, seed=1)
    tokenizer = trainer.get_tokenizer()
    prompt_tokens = tokenizer.encode("Write in lower case:")
    letters = set(tokenizer.encode("abcdefghijklmnopqrstuvwxyz"))
    rng = random.Random(0)

    def reward(sequence) -> float:  # the share of lower-case letters: ~26/259 for the untrained model
        return sum(t in letters for t in sequence.tokens) / len(sequence.tokens)

    mean_rewards = []
    for _iteration in range(12):
        sampler = trainer.save_weights_and_get_sampling_client()
        rollouts = sampler.sample(
            prompt=trio.ModelInput.from_ints(prompt_tokens),
            sampling_params=trio.SamplingParams(max_tokens=8, temperature=1.0, seed=rng.randrange(2**31)),
            num_samples=8,
        ).result()
        rewards = [reward(s) for s in rollouts.sequences]
        mean_rewards.append(sum(rewards) / len(rewards))
        baseline = sum(rewards) / len(rewards)
        training_data = []
        for sequence, r in zip(rollouts.sequences, rewards):
            completion_tokens = list(sequence.tokens)
            tokens = prompt_tokens + completion_tokens
            old_logprobs = [0.0] * len(prompt_tokens) + [float(v) for v in sequence.logprobs]
            advantages = [0.0] * len(prompt_tokens) + [r - baseline] * len(completion_tokens)
            targets = [-100] * (len(prompt_tokens) - 1) + completion_tokens
            training_data.append(trio.Datum(
                model_input=trio.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": targets, "logprobs": old_logprobs[1:], "advantages": advantages[1:]},
            ))
        if any(r != baseline for r in rewards):
            trainer.forward_backward(training_data, loss_fn="importance_sampling").result()
            trainer.optim_step(trio.AdamParams(learning_rate=3e-2)).result()
    first, last = sum(mean_rewards[:3]) / 3, sum(mean_rewards[-3:]) / 3
    assert first < 0.3 and last > first + 0.3, mean_rewards
