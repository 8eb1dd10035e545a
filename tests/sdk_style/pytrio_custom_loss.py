"""Custom loss with forward_backward_custom in pytrio 0.2.9 style.

Origin (site-packages/pytrio, pytrio==0.2.9):
- client/training.py:359-388  forward_backward_custom(data, loss_fn, loss_fn_config=None) docstring:
  "loss_fn: Function that maps samples and per-sample logprobs to a scalar loss tensor and custom
  metrics. loss_fn_config: Optional configuration passed only to the local loss function as a single
  mapping."
- client/training.py:63-97    CustomLossFn = Callable[[list[Datum], list[torch.Tensor]], (Tensor, dict[str, float])]
  or Callable[[list[Datum], list[torch.Tensor], dict[str, object]], ...]; the 3-argument form is used
  only when loss_fn_config is not None and the signature binds (data, logprobs, config).
- pytrio TensorData has no .to_torch(): use torch.tensor(td.data).reshape(td.shape)
  (types/forward/tensor_data.py:14-191).
"""

import os

import torch

import trio_widgets as trio  # was: import pytrio as trio

BASE_MODEL = os.environ.get("BASE_MODEL", "Qwen/Qwen3.5-4B")

service = trio.ServiceClient()
trainer = service.create_lora_training_client(base_model=BASE_MODEL, rank=32)
tokenizer = trainer.get_tokenizer()

tokens = tokenizer.encode("The quick brown fox jumps over the lazy dog")
data = [
    trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [1.0] * (len(tokens) - 1),
        },
    )
]


def weighted_nll(data, logprobs_list, config):
    scale = float(config.get("scale", 1.0))
    total = torch.zeros(())
    for datum, logprobs in zip(data, logprobs_list):
        w = datum.loss_fn_inputs["weights"]
        weights = torch.tensor(w.data, dtype=torch.float32).reshape(w.shape)
        total = total - scale * (logprobs * weights).sum()
    return total, {"custom_nll": float(total.detach())}


# Blocks through the forward pass, runs the loss locally, submits the backward; returns an APIFuture.
future = trainer.forward_backward_custom(data, weighted_nll, loss_fn_config={"scale": 1.0})
trainer.optim_step(trio.AdamParams(learning_rate=1e-4)).result()
result = future.result()
print(result.metrics)  # backend loss_sum/loss_mean/token_count (of the surrogate) + custom_nll
