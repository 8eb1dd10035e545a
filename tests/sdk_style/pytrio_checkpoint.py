"""Checkpoint save / resume / sample in pytrio 0.2.9 style.

Origin (site-packages/pytrio, pytrio==0.2.9):
- client/training.py:694-709   save_state(name, ttl_seconds=None, overwrite=False) -> APIFuture[SaveWeightsResponse]
  ("resolves to the checkpoint URI, model, and size": .path / .model / .size)
- client/service.py:778-791    create_training_client_from_state_with_optimizer(path) -> TrainingClient
  ("path: Checkpoint URI returned by ``save_state``")
- client/training.py:756-770   save_weights_for_sampler(name, ttl_seconds=None) -> APIFuture[SaveWeightsForSamplerResponse]
- client/training.py:1073-1082 TrainingClient.create_sampling_client(model_path) -> SamplingClient
- client/service.py:584-606    ServiceClient.create_sampling_client(base_model, model_path=None) (base_model required)
- client/service.py:224-234 + client/rest.py:199-210 create_rest_client().list_checkpoints(run_id) ->
  concurrent.futures.Future[CheckpointsListResponse]
- client/sampling.py:204-217   compute_logprobs(prompt) -> APIFuture[list[float | None]]
- types/sample/sample_response.py:40  SampleResponse.type == "sample"
- client/rest.py:325-348       download_checkpoint(checkpoint_id, destination_path, *, resume=True)
  -> concurrent.futures.Future[CheckpointDownloadResult]
"""

import os
import tempfile

import trio_widgets as trio  # was: import pytrio as trio

BASE_MODEL = os.environ.get("BASE_MODEL", "Qwen/Qwen3.5-4B")

service = trio.ServiceClient()
trainer = service.create_lora_training_client(base_model=BASE_MODEL, rank=32)
tokenizer = trainer.get_tokenizer()

tokens = tokenizer.encode("Checkpoints keep training state.")
batch = [
    trio.Datum(
        model_input=trio.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
]
trainer.forward_backward(batch, "cross_entropy").result()
trainer.optim_step(trio.AdamParams(learning_rate=1e-4)).result()

saved = trainer.save_state("checkpoint-001", ttl_seconds=86400).result()
print(f"Saved to: {saved.path} (model={saved.model}, size={saved.size} bytes)")

# Resume into a new training client with weights + optimizer state.
resumed = service.create_training_client_from_state_with_optimizer(saved.path)
resumed.forward_backward(batch, "cross_entropy").result()
resumed.optim_step(trio.AdamParams(learning_rate=1e-4)).result()

# Persistent sampler weights -> a sampling client on them.
sampler_weights = resumed.save_weights_for_sampler("sampler-001").result()
sampler = resumed.create_sampling_client(sampler_weights.path)
# equivalently: service.create_sampling_client(BASE_MODEL, model_path=sampler_weights.path)
out = sampler.sample(
    prompt=trio.ModelInput.from_ints(tokenizer.encode("Checkpoints")),
    num_samples=1,
    sampling_params=trio.SamplingParams(max_tokens=10),
).result()
print(out.sequences[0].text)
print("sample response type:", out.type)

logprobs = sampler.compute_logprobs(trio.ModelInput.from_ints(tokens)).result()
print("prompt logprobs:", logprobs[:5])

rest = service.create_rest_client()
# NOTE: assumes RestClient's training_run_id == TrainingClient.training_run_cuid (both are Control ids; not
# stated explicitly in the SDK). RestClient sync methods return concurrent.futures.Future -> use .result().
for checkpoint in rest.list_checkpoints(trainer.training_run_cuid).result().checkpoints:
    print(f"  {checkpoint.checkpoint_type}: {checkpoint.checkpoint_id} -> {checkpoint.path}")

# Download a listed checkpoint by its id.
done = rest.download_checkpoint(checkpoint.checkpoint_id, os.path.join(tempfile.mkdtemp(), "download")).result()
print(f"downloaded {done.checkpoint_id}: {done.bytes_written} bytes")
