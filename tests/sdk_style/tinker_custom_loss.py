"""Custom loss with forward_backward_custom in tinker 0.38.0 style (callable and LossHandle forms).

Origin (site-packages/tinker, tinker==0.38.0):
- lib/public_interfaces/training_client.py:520-554  forward_backward_custom docstring:
      def custom_loss(data, logprobs_list):
          loss = torch.mean(torch.stack([torch.mean(lp) for lp in logprobs_list]))
          metrics = {"custom_metric": loss.item()}
          return loss, metrics
      future = training_client.forward_backward_custom(data, custom_loss)
  and the `target_distribution` example (2-D target_tokens + TensorData(dtype="float32", shape=[1, 2])).
- lib/public_interfaces/service_client.py:738-748   create_custom_loss docstring:
      def neg_ll(logprobs, weights):
          loss = -(logprobs * weights).sum()
          return loss, {"custom/neg_ll:sum": loss}
      loss_handle = service_client.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()
      result = training_client.forward_backward_custom(data, loss_handle).result()
"""

import os

import torch

import trio_widgets as tinker  # was: import tinker
from trio_widgets import types  # was: from tinker import types

BASE_MODEL = os.environ.get("BASE_MODEL", "Qwen/Qwen3-8B")

service_client = tinker.ServiceClient()
training_client = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=16).result()
tokenizer = training_client.get_tokenizer()

tokens = tokenizer.encode("The quick brown fox jumps over the lazy dog")
data = [
    types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
]


# 1) A plain callable: (data, logprobs_list) -> (scalar loss tensor, metrics dict).
def custom_loss(data, logprobs_list):
    loss = -torch.stack(
        [(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs_list)]
    ).sum()
    metrics = {"custom_metric": loss.item()}
    return loss, metrics


future = training_client.forward_backward_custom(data, custom_loss)
optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-4))
result = future.result()
optim_future.result()
print("callable custom loss metrics:", result.metrics)  # loss:sum = custom loss, surrogate_loss:sum added


# 2) A traced per-datum loss created once per session (LossHandle).
def neg_ll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


loss_handle = service_client.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()
result = training_client.forward_backward_custom(data, loss_handle).result()
training_client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
print("LossHandle metrics:", result.metrics)

service_client.close("success").result()
