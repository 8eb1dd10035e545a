"""Base models: the built-in one, and real Hugging Face models loaded from disk or the local cache."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import random_batch
from numerics import assert_fp32_close, model_terms

import trio_widgets as trio
from trio_widgets.engine.models import byte_tokenizer, usable_cpus


def _save_tiny_qwen2(path) -> None:
    """A different architecture than the built-in one (Qwen2, grouped-query attention), saved for real."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


def _train(pool, base_model: str, steps: int = 8, lr: float = 3e-3) -> list[float]:
    tc = trio.ServiceClient(pool).create_lora_training_client(base_model, rank=8, seed=0)
    batch = random_batch(3, n=2, length=24, vary=True)
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(batch)
        tc.optim_step(trio.AdamParams(learning_rate=lr))
        losses.append(fb.result(timeout=60).metrics["loss:sum"])
    return losses


def test_local_directory_model_trains(tmp_path, pool):
    _save_tiny_qwen2(tmp_path / "qwen2-tiny")
    losses = _train(pool, str(tmp_path / "qwen2-tiny"))
    assert losses[-1] < 0.9 * losses[0]
    tc = trio.ServiceClient(pool).create_lora_training_client(str(tmp_path / "qwen2-tiny"), rank=2)
    assert tc.get_tokenizer().decode(tc.get_tokenizer().encode("hi", add_special_tokens=False)) == "hi"
    base = pool.get_base_model(str(tmp_path / "qwen2-tiny"))
    assert base.context_length == 128 and "lm_head" in base.lora_targets
    assert str(tmp_path / "qwen2-tiny") in [m.model_name for m in
                                            trio.ServiceClient(pool).get_server_capabilities().supported_models]


def test_packed_logits_equal_plain_model_with_gqa(tmp_path):
    """The packed varlen pass over several sequences equals running each sequence alone."""
    from transformers import AutoModelForCausalLM

    from trio_widgets.engine.compute import _target_logprobs, _Work, make_forward_job
    from trio_widgets.engine.models import load_base_model

    _save_tiny_qwen2(tmp_path / "m")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    base = load_base_model(str(tmp_path / "m"), torch.device("cpu"))
    batch = random_batch(9, n=4, length=20, vary=True)
    job, _ = make_forward_job(base, batch, "cross_entropy", {}, backward=False)
    with torch.no_grad():
        packed, _plan = _target_logprobs(base, [_Work(None, job, "t")], [(0, i) for i in range(len(batch))])
        for datum, logp in zip(batch, packed):
            logits = plain(input_ids=torch.tensor([datum.model_input.to_ints()])).logits[0]
            targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
            expected = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
            assert_fp32_close(logp, expected, model_terms(plain.config, datum.model_input.length),
                              "packed logprobs vs the plain model's")


@pytest.mark.no_numerics
def test_model_from_the_local_hf_cache(tmp_path):
    """An id already in the local Hugging Face cache loads offline (a real cache layout)."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--qwen2-tiny" / "snapshots" / ("0" * 40)
    _save_tiny_qwen2(snapshot)
    (cache / "models--someone--qwen2-tiny" / "refs").mkdir(parents=True)
    (cache / "models--someone--qwen2-tiny" / "refs" / "main").write_text("0" * 40)
    code = (
        "import trio_widgets as trio\n"
        "with trio.LocalPool(min_cycle_s=0) as p:\n"
        "    tc = trio.ServiceClient(p).create_lora_training_client('someone/qwen2-tiny', rank=2)\n"
        "    print(tc.get_info().model_data.base_model, p.get_base_model('someone/qwen2-tiny').context_length)\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["someone/qwen2-tiny", "128"]


def test_builtin_model_is_deterministic_and_on_cpu_fp32(pool):
    base = pool.get_base_model(trio.DEFAULT_MODEL)
    from trio_widgets.engine.models import _build_builtin

    again, tokenizer = _build_builtin(trio.DEFAULT_MODEL, torch.float32)
    assert base.dtype == torch.float32 and base.device.type == "cpu"
    assert torch.equal(base.model.get_input_embeddings().weight, again.get_input_embeddings().weight)
    assert base.vocab_size == len(tokenizer) == 259


def test_default_model_learns_within_a_few_updates(pool):
    losses = _train(pool, trio.DEFAULT_MODEL, steps=10)
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("files, expected", [
    ({"cpu.max": "100000 100000\n"}, 1),              # cgroup v2, one CPU (Binder)
    ({"cpu.max": "150000 100000\n"}, 1),              # 1.5 CPUs: two threads would be throttled
    ({"cpu.max": "50000 100000\n"}, 1),               # half a CPU still gets one thread
    ({"cpu.max": "max 100000\n"}, None),              # unlimited: the affinity mask decides
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),                                       # no cgroup files at all
])
def test_usable_cpus_honours_a_cgroup_quota(tmp_path, files, expected):
    """os.cpu_count() in a container is the host's; the pool sizes its threads from the quota."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == (min(affinity, expected) if expected is not None else affinity)
