"""Async RL loop (importance sampling) in pytrio 0.2.9 style.

Origin: the package README ("Rollouts in, policy updates out"),
site-packages/pytrio-0.2.9.dist-info/METADATA lines 115-164, moved onto the `_async` twins:
- ServiceClient.create_lora_training_client_async -> TrainingClient (client/service.py:424-459)
- TrainingClient.save_weights_and_get_sampling_client_async -> SamplingClient (client/training.py:1084-1090)
- SamplingClient.sample_async -> SampleResponse directly (client/sampling.py:92-128)
- TrainingClient.forward_backward_async / optim_step_async -> APIFuture (await twice:
  once for submission, once for the result; client/training.py:544-573, 665-676)

README body kept: `old_logprobs = [0.0]*len(prompt_tokens) + [0.0 if v is None else float(v) for v in
sequence.logprobs]`, advantages per token, `loss_fn="importance_sampling"`, `sequence.text`.
"""

import asyncio
import os

import trio_widgets as trio  # was: import pytrio as trio

BASE_MODEL = os.environ.get("BASE_MODEL", "Qwen/Qwen3.5-4B")


async def main() -> None:
    service = trio.ServiceClient()  # constructor authenticates synchronously
    trainer = await service.create_lora_training_client_async(base_model=BASE_MODEL, rank=32)
    tokenizer = trainer.get_tokenizer()

    question = "What is 6 * 8?"
    prompt_tokens = tokenizer.encode(
        f"Question: {question}\nReturn only the final numeric answer.\nAnswer:"
    )

    for step in range(5):
        # Refresh the sampler from the latest weights on every iteration (on-policy loop).
        sampler = await trainer.save_weights_and_get_sampling_client_async()
        rollouts = await sampler.sample_async(
            prompt=trio.ModelInput.from_ints(prompt_tokens),
            sampling_params=trio.SamplingParams(max_tokens=8, temperature=0.7),
            num_samples=4,
        )

        training_data = []
        for sequence in rollouts.sequences:
            reward = 2.0 if (sequence.text or "").strip() == "48" else -1.0
            completion_tokens = list(sequence.tokens)
            tokens = prompt_tokens + completion_tokens
            old_logprobs = (
                [0.0] * len(prompt_tokens)
                + [0.0 if value is None else float(value) for value in sequence.logprobs]
            )
            advantages = [0.0] * len(prompt_tokens) + [reward] * len(completion_tokens)
            training_data.append(
                trio.Datum(
                    model_input=trio.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": old_logprobs[1:],
                        "advantages": advantages[1:],
                    },
                )
            )

        fb_future = await trainer.forward_backward_async(training_data, loss_fn="importance_sampling")
        opt_future = await trainer.optim_step_async(trio.AdamParams(learning_rate=1e-5))
        fb = await fb_future
        await opt_future
        print(f"step {step}: loss_sum={fb.metrics['loss_sum']:.4f} token_count={fb.metrics['token_count']}")


if __name__ == "__main__":
    asyncio.run(main())
