"""PyTRIO user code against `trio serve` (not a test module: tests/test_serve_pytrio.py runs it in a
process of its own, as a user runs a script). The real pytrio 0.2.9, unmodified, configured only
by PYTRIO_BASE_URL and PYTRIO_API_KEY. Writes what it saw as JSON to argv[1]/results.json, and
its run id to argv[1]/pytrio_run (another key's client on the same pool must not see it); reads
that client's run id from argv[1]/tinker_run and checks it cannot see it either.

The loops are written in PyTRIO's style (its README's): `.result()` on every op, `-100` targets
for the prompt, `save_weights_and_get_sampling_client()` as the sampler, a custom loss through
`forward_backward_custom`."""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import pytrio
import torch
import torch.nn.functional as F
from pytrio.errors.control import ControlAPIError

MODEL = "trio/tiny-llama-byte"
WHERE = Path(sys.argv[1])
out: dict = {}


def datum(tokens: list[int], targets: list[int] | None = None) -> pytrio.Datum:
    targets = tokens[1:] if targets is None else targets
    return pytrio.Datum(model_input=pytrio.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(targets)})


def basics(sc: pytrio.ServiceClient) -> None:
    out["models"] = sc.get_supported_models()
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=0)
    (WHERE / "pytrio_run.part").write_text(tc.training_run_cuid)
    (WHERE / "pytrio_run.part").rename(WHERE / "pytrio_run")  # whole or absent: the test waits for it to exist
    tokenizer = tc.get_tokenizer()
    batch = [datum(tokenizer.encode(t)) for t in ("hello trio, hello pool", "one pool, many runs")]
    losses = []
    for _ in range(6):
        fb = tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(pytrio.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.metrics["loss_mean"])
    out["losses"] = losses
    state = tc.save_state("state-1").result()
    out["state_path"] = state.path
    out["after"] = tc.forward(batch, "cross_entropy").result().metrics["loss_mean"]
    weights = tc.save_weights_for_sampler("weights-1").result()
    out["weights_path"] = weights.path
    sampler = tc.create_sampling_client(weights.path)
    prompt = pytrio.ModelInput.from_ints(tokenizer.encode("hello"))
    result = sampler.sample(prompt, num_samples=2, sampling_params=pytrio.SamplingParams(max_tokens=6, seed=3)).result()
    out["samples"] = [[list(s.tokens), s.text, len(s.logprobs)] for s in result.sequences]
    rest = sc.create_rest_client()
    out["runs"] = [r.training_run_id for r in rest.list_training_runs().result().training_runs]
    listed = rest.list_checkpoints(tc.training_run_cuid).result().checkpoints
    out["checkpoints"] = sorted((c.checkpoint_type, c.path) for c in listed)
    training = next(c for c in listed if c.checkpoint_type == "training")
    got = rest.download_checkpoint(training.checkpoint_id, WHERE / "download" / "state.tar").result()
    out["download"] = [str(got.path), got.bytes_written]
    # resume, both ways: a new client from the state, and load_state_with_optimizer before the first op
    resumed = sc.create_training_client_from_state(state.path)
    out["resumed"] = resumed.forward(batch, "cross_entropy").result().metrics["loss_mean"]
    loaded = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=0)
    loaded.load_state_with_optimizer(state.path).result()
    fb = loaded.forward_backward(batch, "cross_entropy").result()
    loaded.optim_step(pytrio.AdamParams(learning_rate=1e-2)).result()
    out["loaded"] = fb.metrics["loss_mean"]


def isolation(sc: pytrio.ServiceClient) -> None:
    deadline = time.monotonic() + 60
    while not (WHERE / "tinker_run").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    other = (WHERE / "tinker_run").read_text()
    rest = sc.create_rest_client()
    try:
        rest.get_training_run(other).result()
        out["sees_other"] = "yes"
    except ControlAPIError as exc:
        out["sees_other"] = exc.status_code
    out["runs_after"] = [r.training_run_id for r in rest.list_training_runs().result().training_runs]


def sft(sc: pytrio.ServiceClient) -> None:
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=1)
    tok = tc.get_tokenizer()
    batch = []
    for prompt, answer in (("Q: what is a pool? A:", " many runs"), ("Q: what is a cycle? A:", " one step")):
        p, a = tok.encode(prompt), tok.encode(answer)
        batch.append(datum(p + a, [-100] * (len(p) - 1) + a))  # the prompt is not learned
    losses = []
    for _ in range(8):
        losses.append(tc.forward_backward(batch, "cross_entropy").result().metrics["loss_mean"])
        tc.optim_step(pytrio.AdamParams(learning_rate=2e-2)).result()
    out["sft"] = losses


def dpo(sc: pytrio.ServiceClient) -> None:
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=2)
    tok = tc.get_tokenizer()

    def pair(prompt: str, completion: str) -> pytrio.Datum:
        p, c = tok.encode(prompt), tok.encode(completion)
        tokens, targets = p + c, [-100] * (len(p) - 1) + c
        return pytrio.Datum(model_input=pytrio.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": targets})

    data = [pair(q, good) if i == 0 else pair(q, bad)
            for q, good, bad in (("2+2=", "4", "5"), ("3+3=", "6", "8")) for i in range(2)]
    reference = [float(torch.tensor(o["logprobs"].data).sum())
                 for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]

    def dpo_loss(batch, logprobs):
        seq = [lp.sum() for lp in logprobs]
        margins = [0.5 * ((seq[i] - reference[i]) - (seq[i + 1] - reference[i + 1])) for i in range(0, len(seq), 2)]
        loss = torch.stack([-F.logsigmoid(m) for m in margins]).mean()
        return loss, {"dpo": float(loss)}

    losses = []
    for _ in range(6):
        losses.append(tc.forward_backward_custom(data, dpo_loss).result().metrics["dpo"])
        tc.optim_step(pytrio.AdamParams(learning_rate=3e-2)).result()
    out["dpo"] = losses


def grpo(sc: pytrio.ServiceClient) -> None:
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=3)
    tok = tc.get_tokenizer()
    prompt, rng = tok.encode("abc:"), random.Random(0)
    goal = set(tok.encode("abcdefghijklmnopqrstuvwxyz"))  # the reward: lowercase letters
    rewards_seen = []
    for _ in range(8):
        sampler = tc.save_weights_and_get_sampling_client()
        rollouts = sampler.sample(pytrio.ModelInput.from_ints(prompt), num_samples=8,
                                  sampling_params=pytrio.SamplingParams(max_tokens=6, seed=rng.randrange(2**31))
                                  ).result().sequences
        rewards = [sum(t in goal for t in s.tokens) / len(s.tokens) for s in rollouts]
        mean = sum(rewards) / len(rewards)
        rewards_seen.append(mean)
        data = []
        for s, r in zip(rollouts, rewards):
            tokens = prompt + list(s.tokens)
            data.append(pytrio.Datum(model_input=pytrio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": [-100] * (len(prompt) - 1) + list(s.tokens),
                "logprobs": [0.0] * (len(prompt) - 1) + list(s.logprobs),
                "advantages": [0.0] * (len(prompt) - 1) + [r - mean] * len(s.tokens)}))
        if any(r != mean for r in rewards):
            tc.forward_backward(data, "importance_sampling").result()
            tc.optim_step(pytrio.AdamParams(learning_rate=5e-2)).result()
    out["grpo"] = rewards_seen


def main() -> None:
    started = time.monotonic()
    sc = pytrio.ServiceClient()  # PYTRIO_BASE_URL, PYTRIO_API_KEY: nothing else
    out["session"] = sc.service_session_cuid
    chosen = sys.argv[2].split(",") if len(sys.argv) > 2 else None  # e.g. "basics" (against a fleet)
    for part in (basics, isolation, sft, dpo, grpo):
        if chosen is not None and part.__name__ not in chosen:
            continue
        began = time.monotonic()
        try:
            part(sc)
        except Exception as exc:  # reported to the test, which names the part
            out.setdefault("errors", {})[part.__name__] = f"{type(exc).__name__}: {exc}"[:2000]
        out.setdefault("seconds", {})[part.__name__] = round(time.monotonic() - began, 2)
    out["total_s"] = round(time.monotonic() - started, 2)
    assert all(math.isfinite(x) for x in out.get("losses", []))
    (WHERE / "results.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
