"""Quickstart SFT loop in pytrio 0.2.9 style.

Origin: the package README ("Train, then sample"), site-packages/pytrio-0.2.9.dist-info/METADATA
lines 62-113 (quoted nearly verbatim; only BASE_MODEL is made overridable):

    service = trio.ServiceClient()
    trainer = service.create_lora_training_client(base_model="Qwen/Qwen3.5-4B", rank=32)
    tokenizer = trainer.get_tokenizer()
    ...
    for step in range(10):
        trainer.forward_backward(batch, "cross_entropy").result()
        trainer.optim_step(trio.AdamParams(learning_rate=1e-4)).result()
    sampler = trainer.save_weights_and_get_sampling_client()
    result = sampler.sample(prompt=..., sampling_params=trio.SamplingParams(max_tokens=32, temperature=0.0),
                            num_samples=1).result()
    print(result.sequences[0].text)

pytrio specifics visible here: creation methods return clients directly (no .result());
`save_weights_and_get_sampling_client()` returns a SamplingClient directly (client/training.py:1103-1109);
metrics are `loss_sum` / `loss_mean` / `token_count` (client/adapters/training.py:71-83).
"""

import os

import trio_widgets as trio  # was: import pytrio as trio

BASE_MODEL = os.environ.get("BASE_MODEL", "Qwen/Qwen3.5-4B")

# Connect to the PyTRIO training engine.
service = trio.ServiceClient()
trainer = service.create_lora_training_client(
    base_model=BASE_MODEL,
    rank=32,
)
tokenizer = trainer.get_tokenizer()

# Prepare one supervised training example.
tokens = tokenizer.encode(
    "Question: what is Trio?\nAnswer: a model training platform."
)
batch = [
    trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [1.0] * (len(tokens) - 1),
        },
    )
]

# Every step of the training loop stays in your hands.
for step in range(10):
    out = trainer.forward_backward(batch, "cross_entropy").result()
    trainer.optim_step(trio.AdamParams(learning_rate=1e-4)).result()
    print(f"step {step}: loss_mean={out.metrics['loss_mean']:.4f} tokens={out.metrics['token_count']}")

# Save the latest policy and sample from it immediately.
sampler = trainer.save_weights_and_get_sampling_client()
prompt_tokens = tokenizer.encode("Question: what is Trio?\nAnswer:")
result = sampler.sample(
    prompt=trio.ModelInput.from_ints(prompt_tokens),
    sampling_params=trio.SamplingParams(max_tokens=32, temperature=0.0),
    num_samples=1,
).result()

print(result.sequences[0].text)
