"""Quickstart SFT loop in tinker 0.38.0 style (synchronous, `.result()`).

Origin (all in site-packages/tinker, tinker==0.38.0):
- lib/public_interfaces/service_client.py:68-78   ServiceClient docstring: `client = ServiceClient()`,
  `client.create_lora_training_client(base_model="Qwen/Qwen3-8B").result()`
- lib/public_interfaces/training_client.py:175-183  TrainingClient docstring: forward_backward + optim_step
  futures submitted back to back, then `.result()` on each
- lib/public_interfaces/training_client.py:369-385  forward_backward docstring (Datum / ModelInput.from_ints)
- lib/public_interfaces/training_client.py:1399-1408 save_weights_and_get_sampling_client docstring:
  `sampling_client = training_client.save_weights_and_get_sampling_client().result()` and
  `sampling_client.sample(prompt, 1, params).result()`
- lib/public_interfaces/sampling_client.py:524-532 sample docstring (decode `sequence.tokens`)

Note: ForwardBackwardOutput has NO `.loss` attribute in 0.38 (types/forward_backward_output.py:11-42);
the docstrings' `result.loss` is stale. The loss lives in `result.metrics["loss:sum"]`.
"""

import os

import trio_widgets as tinker  # was: import tinker
from trio_widgets import types  # was: from tinker import types

BASE_MODEL = os.environ.get("BASE_MODEL", "Qwen/Qwen3-8B")

service_client = tinker.ServiceClient()  # reads TINKER_API_KEY / TINKER_BASE_URL; no network until first use
training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=16).result()
tokenizer = training_client.get_tokenizer()

# One SFT example: predict completion tokens only (prompt positions weighted 0).
prompt_tokens = tokenizer.encode("Question: what is 6 * 8?\nAnswer:")
completion_tokens = tokenizer.encode(" 48")
full_sequence = prompt_tokens + completion_tokens
input_tokens = full_sequence[:-1]
target_tokens = full_sequence[1:]
weights = [0.0] * (len(prompt_tokens) - 1) + [1.0] * len(completion_tokens)

datum = types.Datum(
    model_input=types.ModelInput.from_ints(input_tokens),
    loss_fn_inputs={"target_tokens": target_tokens, "weights": weights},
)

for step in range(10):
    # Submit both before waiting: requests on one TrainingClient run in submission order.
    fwdbwd_future = training_client.forward_backward([datum], "cross_entropy")
    optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-4))
    fwdbwd_result = fwdbwd_future.result()
    optim_result = optim_future.result()
    print(f"step {step}: loss:sum={fwdbwd_result.metrics.get('loss:sum')}")

sampling_client = training_client.save_weights_and_get_sampling_client().result()
prompt = types.ModelInput.from_ints(prompt_tokens)
params = types.SamplingParams(max_tokens=20, temperature=0.0)
result = sampling_client.sample(prompt, 1, params).result()
for sequence in result.sequences:
    print(repr(tokenizer.decode(sequence.tokens)))

service_client.close("success").result()
