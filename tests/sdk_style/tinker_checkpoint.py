"""Checkpoint save / resume / sample in tinker 0.38.0 style.

Origin (site-packages/tinker, tinker==0.38.0):
- lib/public_interfaces/training_client.py:888-894   save_state docstring (`result.path`)
- lib/public_interfaces/service_client.py:576-583    create_training_client_from_state_with_optimizer docstring
- lib/public_interfaces/training_client.py:1153-1164 save_weights_for_sampler docstring + create_sampling_client(model_path=...)
- lib/public_interfaces/rest_client.py:105-117 / 417-426 RestClient docstring (`tinker.RestClient()`,
  `list_checkpoints(run_id).result()`, `checkpoint.checkpoint_type`)
- lib/public_interfaces/sampling_client.py:675-686   compute_logprobs with prompt_logprobs_last_n
"""

import os

import trio_widgets as tinker  # was: import tinker
from trio_widgets import types  # was: from tinker import types

BASE_MODEL = os.environ.get("BASE_MODEL", "Qwen/Qwen3-8B")

service_client = tinker.ServiceClient()
training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=16).result()
tokenizer = training_client.get_tokenizer()
info = training_client.get_info()  # answered locally in 0.38 (fetched once at creation)
print(f"Model ID: {info.model_id}, base model: {info.model_data.model_name}, LoRA rank: {info.lora_rank}")

tokens = tokenizer.encode("Checkpoints keep training state.")
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
)
training_client.forward_backward([datum], "cross_entropy").result()
training_client.optim_step(types.AdamParams(learning_rate=1e-4)).result()

# Save full training state (weights + optimizer), with metadata and a 1-day TTL.
save_result = training_client.save_state("checkpoint-001", ttl_seconds=86400, user_metadata={"step": "1"}).result()
print(f"Saved to: {save_result.path}")  # tinker://<run-id>/weights/checkpoint-001

# Resume in a new training client (weights + Adam moments).
resumed = service_client.create_training_client_from_state_with_optimizer(save_result.path).result()
resumed.forward_backward([datum], "cross_entropy").result()
resumed.optim_step(types.AdamParams(learning_rate=1e-4)).result()

# Persistent sampler weights, then a sampling client on them.
sampler_result = resumed.save_weights_for_sampler("sampler-001").result()
print(f"Sampler weights saved to: {sampler_result.path}")
sampling_client = service_client.create_sampling_client(model_path=sampler_result.path).result()
out = sampling_client.sample(
    prompt=types.ModelInput.from_ints(tokenizer.encode("Checkpoints")),
    num_samples=1,
    sampling_params=types.SamplingParams(max_tokens=10),
).result()
print(repr(tokenizer.decode(out.sequences[0].tokens)))

# log P(completion | context), scoring only the completion suffix.
context = tokenizer.encode("Checkpoints keep")
completion = tokenizer.encode(" training state.")
logprobs = sampling_client.compute_logprobs(
    types.ModelInput.from_ints(context + completion), prompt_logprobs_last_n=len(completion)
).result()
print("completion logprob:", sum(lp for lp in logprobs[-len(completion):] if lp is not None))

# List checkpoints of the run via the session-less RestClient.
rest_client = tinker.RestClient()
run_id = types.ParsedCheckpointTinkerPath.from_tinker_path(save_result.path).training_run_id
for checkpoint in rest_client.list_checkpoints(run_id).result().checkpoints:
    print(f"  {checkpoint.checkpoint_type}: {checkpoint.checkpoint_id} -> {checkpoint.tinker_path}")

service_client.close("success").result()
