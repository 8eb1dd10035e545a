"""Async RL loop (importance-sampling REINFORCE) in tinker 0.38.0 style.

Uses the 0.38 recommended pattern: the non-`_async` methods return futures at once and are
awaited directly; the `*_async` twins are deprecated with a FutureWarning.

Origin (site-packages/tinker, tinker==0.38.0):
- lib/public_interfaces/api_future.py:22-44       `result = await api_future` (APIFuture docstring)
- lib/public_interfaces/training_client.py:465-471 deprecation text of forward_backward_async:
  "`fwd_bwd_future = client.forward_backward(...); optim_future = client.optim_step(...);
   await fwd_bwd_future; await optim_future`"
- lib/public_interfaces/backcompat_training_client_future.py:36-44 `training_client = await
  service_client.create_lora_training_client(base_model="Qwen/Qwen3-8B")`
- lib/public_interfaces/training_client.py:1399-1408 / sampling_client.py:524-532 sampling
- Datum keys for importance_sampling (target_tokens, logprobs, advantages): types/datum.py:27-35
  and the tinker docs losses page (https://tinker-docs.thinkingmachines.ai/tinker/losses/importance-sampling/).
"""

import asyncio
import os

import trio_widgets as tinker  # was: import tinker
from trio_widgets import types  # was: from tinker import types

BASE_MODEL = os.environ.get("BASE_MODEL", "Qwen/Qwen3-8B")


def reward(text: str) -> float:
    return 1.0 if text.strip().startswith("48") else 0.0


async def main() -> None:
    service_client = tinker.ServiceClient()
    training_client = await service_client.create_lora_training_client(base_model=BASE_MODEL, rank=16)
    tokenizer = training_client.get_tokenizer()
    prompt_tokens = tokenizer.encode("Question: what is 6 * 8?\nAnswer:")
    prompt = types.ModelInput.from_ints(prompt_tokens)
    params = types.SamplingParams(max_tokens=8, temperature=1.0)

    for step in range(5):
        sampling_client = await training_client.save_weights_and_get_sampling_client()
        response = await sampling_client.sample(prompt=prompt, num_samples=4, sampling_params=params)

        rewards = [reward(tokenizer.decode(seq.tokens)) for seq in response.sequences]
        mean_reward = sum(rewards) / len(rewards)
        data = []
        for seq, r in zip(response.sequences, rewards):
            completion = list(seq.tokens)
            sampled_logprobs = list(seq.logprobs or [0.0] * len(completion))
            tokens = prompt_tokens + completion
            n_prompt = len(prompt_tokens) - 1
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * n_prompt + sampled_logprobs,
                        "advantages": [0.0] * n_prompt + [r - mean_reward] * len(completion),
                    },
                )
            )

        fwd_bwd_future = training_client.forward_backward(data, "importance_sampling")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-5))
        fwd_bwd_result = await fwd_bwd_future
        await optim_future
        print(f"step {step}: mean reward {mean_reward:.2f}, loss:sum {fwd_bwd_result.metrics.get('loss:sum')}")

    await service_client.close("success")


if __name__ == "__main__":
    asyncio.run(main())
