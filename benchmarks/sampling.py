"""Sampling for many LoRA tenants vs PEFT + transformers `generate`, side by side in one run.

8 tenants (rank 32, alpha 32), 4 samples each of a prompt of their own (16-23 tokens),
temperature 1, no top-k / top-p, every sample `--new` tokens long (no stop). Arms, medians
of interleaved repetitions, all at the pool's torch thread count:

  pool        the tenants' `sample` requests in one cycle of a `LocalPool` (public API)
  sequential  PEFT `generate`, one adapter after another (4 rows each)
  fused       PEFT `generate` of all 32 rows through one adapter: the ceiling a user could
              reach by hand with one batched call (it serves only one tenant's adapter)
  limit       the machine's matmul rate for this shape: the base's linears of one decode
              step (32 rows x every projection and the head), timed in the same run, each
              through the faster of F.linear (MKL) and oneDNN with its weight packed (what the
              pool uses for large weights, engine/kernels.py), as tokens/s (what a decode that
              did nothing but those matmuls would reach)

Targets (issue 33): pool >= 1.5x fused on both shapes; pool >= 40% of the limit on the Llama
shape. Also: the pool's peak RSS while it samples (the KV cache is freed when it finishes).

Run: .venv/bin/python benchmarks/sampling.py [--shapes builtin,llama] [--reps 3] [--device auto]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import side_by_side  # noqa: E402
from vs_peft import TARGET_MODULES, plain_model, save_random_llama  # noqa: E402

import trio_widgets as trio  # noqa: E402
from trio_widgets.engine.kernels import onednn_works, pack_weight, packed_product  # noqa: E402
from trio_widgets.engine.lora import LORA_ALPHA  # noqa: E402
from trio_widgets.engine.models import DEFAULT_MODEL, auto_torch_threads, resolve_device, usable_cpus  # noqa: E402

TENANTS, SAMPLES, RANK = 8, 4, 32
LLAMA = (8, 512, 2816, 8, 2, 32000)  # layers, hidden, intermediate, heads, kv heads, vocab
NEW_TOKENS = {"builtin": 64, "llama": 32}


def prompts(vocab: int) -> list[list[int]]:
    """One prompt per tenant, of different lengths (ids past the special tokens)."""
    return [[3 + (7 * i + 13 * j) % (min(vocab, 256) - 3) for j in range(16 + i)] for i in range(TENANTS)]


@dataclass
class Result:
    seconds: dict[str, float]
    tokens: int
    rss: tuple[float, float, float]  # MiB: before, peak during, after one pool sample
    packed: int  # bytes of the base's weights packed for the decode (engine/kernels.py)


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peft_model(base: torch.nn.Module) -> torch.nn.Module:
    import peft

    config = peft.LoraConfig(r=RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=TARGET_MODULES,
                             bias="none")
    names = [f"t{i}" for i in range(TENANTS)]
    model = peft.get_peft_model(copy.deepcopy(base), config, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, config)
    with torch.no_grad():  # non-zero B, as a trained adapter has (PEFT starts at B = 0)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    model.config.use_cache = True
    return model.eval()


def left_padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(map(len, rows))
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, length - len(row):] = torch.tensor(row)
        mask[i, length - len(row):] = 1
    return ids.to(device), mask.to(device)


def decode_matmuls(model: torch.nn.Module, rows: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input [rows, in], weight [out, in]) of every linear one decode step of the base runs."""
    pairs = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight.detach()
            pairs.append((torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=device), weight))
    return pairs


def measure(shape: str, name: str, device: torch.device, args) -> Result:
    new = args.new or NEW_TOKENS[shape]
    pool = trio.LocalPool(min_cycle_s=0.0, device=device, name=f"sampling-{shape}")
    try:
        service = trio.ServiceClient(pool)
        base = pool.get_base_model(name)
        torch.manual_seed(0)
        samplers = []
        for i in range(TENANTS):
            tc = service.create_lora_training_client(name, rank=RANK, seed=i)
            samplers.append(tc.save_weights_and_get_sampling_client(f"s{i}").result())
        tenant_prompts = prompts(base.vocab_size)
        params = [trio.SamplingParams(max_tokens=new, temperature=1.0, seed=i) for i in range(TENANTS)]

        plain = plain_model(name, base.dtype, device)
        model = peft_model(plain)
        ids, mask = left_padded([p for p in tenant_prompts for _ in range(SAMPLES)], device)
        per_tenant = [left_padded([p] * SAMPLES, device) for p in tenant_prompts]
        matmuls = decode_matmuls(plain, TENANTS * SAMPLES, device)
        generate_args = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0)

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()

        def ours() -> None:
            with pool.hold():
                futures = [s.sample(trio.ModelInput.from_ints(p), SAMPLES, sp)
                           for s, p, sp in zip(samplers, tenant_prompts, params)]
                # delivered by the pool's clock thread, which ran the decode: its torch thread count
                futures[0].add_done_callback(lambda _f: threads.__setitem__("pool", torch.get_num_threads()))
            for f in futures:
                assert all(len(seq.tokens) == new for seq in f.result().sequences)

        def sequential() -> None:
            with pool.hold(), torch.no_grad():
                for i, (tids, tmask) in enumerate(per_tenant):
                    model.set_adapter(f"t{i}")
                    out = model.generate(input_ids=tids, attention_mask=tmask, **generate_args)
                    assert out.shape[1] == tids.shape[1] + new
                sync()

        def fused() -> None:
            with pool.hold(), torch.no_grad():
                model.set_adapter("t0")
                out = model.generate(input_ids=ids, attention_mask=mask, **generate_args)
                assert out.shape[1] == ids.shape[1] + new
                sync()

        kernels = [[lambda x=x, w=w: F.linear(x, w)] for x, w in matmuls]
        if device.type == "cpu" and onednn_works():
            for options, (x, w) in zip(kernels, matmuls):
                options.append(lambda x=x, p=pack_weight(w): packed_product(x, p))
        best = [[float("inf")] * len(options) for options in kernels]

        def limit() -> None:  # a limit is a best case: each kernel's fastest of 5 tries, kept over the reps
            with pool.hold(), torch.no_grad():
                for _ in range(5):
                    for options, times in zip(kernels, best):
                        for i, run in enumerate(options):
                            start = time.perf_counter()
                            run()
                            sync()
                            times[i] = min(times[i], time.perf_counter() - start)

        arms = {"pool": ours, "sequential": sequential, "fused": fused, "limit": limit}
        threads = {"PEFT": torch.get_num_threads()}  # the arms' torch threads: the same, or the run is unfair
        seconds = side_by_side(arms, args.reps)
        print(f"    torch threads: pool {threads.get('pool')} (its clock thread), PEFT and limit {threads['PEFT']}"
              + ("" if threads.get("pool") == threads["PEFT"] else " (UNFAIR: they differ)"))
        seconds["limit"] = sum(min(times) for times in best) * new  # one step's matmuls -> a whole sample's
        rss_ok = _reset_peak_rss()
        before = _rss_mib("VmRSS")
        ours()
        peak, after = _rss_mib("VmHWM") if rss_ok else float("nan"), _rss_mib("VmRSS")
        return Result(seconds, TENANTS * SAMPLES * new, (before, peak, after), base.linears.nbytes)
    finally:
        pool.close()


def report(shape: str, result: Result) -> None:
    s, n = result.seconds, result.tokens
    rate = {k: n / v for k, v in s.items()}
    print("    " + " | ".join(f"{k} {rate[k]:,.0f} tok/s" for k in ("pool", "sequential", "fused", "limit")))
    vs_fused = rate["pool"] / rate["fused"]
    vs_seq = rate["pool"] / rate["sequential"]
    of_limit = rate["pool"] / rate["limit"]
    print(f"    pool vs PEFT one after another {vs_seq:.2f}x | vs PEFT fused batch {vs_fused:.2f}x "
          f"(target >= 1.5x) {'met' if vs_fused >= 1.5 else 'MISSED'} | {of_limit:.0%} of the matmul limit"
          + (f" (target >= 40%) {'met' if of_limit >= 0.4 else 'MISSED'}" if shape == "llama" else "")
          + f" | PEFT fused batch at {rate['fused'] / rate['limit']:.0%} of it")
    before, peak, after = result.rss
    print(f"    RSS of the process around one pool sample: {before:,.0f} MiB before, peak {peak:,.0f} MiB "
          f"(+{peak - before:,.0f}), {after:,.0f} MiB after; the base's packed weights: "
          f"{result.packed / 2**20:,.0f} MiB (kept with the model)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="builtin,llama", help="comma-separated: builtin, llama")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions per arm (medians)")
    parser.add_argument("--new", type=int, default=None, help="new tokens per sample (default: 64 builtin, 32 llama)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    args = parser.parse_args(argv)

    import peft
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    device = resolve_device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"{usable_cpus()} usable CPU(s), {auto_torch_threads()} torch thread(s) (the pool's default)")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
          f"device {device} ({where}); {TENANTS} tenants x {SAMPLES} samples, rank {RANK}, temperature 1; "
          f"medians of {args.reps} interleaved reps")
    with tempfile.TemporaryDirectory(prefix="trio-sampling-") as tmp:
        for shape in args.shapes.split(","):
            if shape == "builtin":
                name = DEFAULT_MODEL
                label = "built-in model (4 layers, d=128, vocab 259)"
            elif shape == "llama":
                dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
                name = save_random_llama(Path(tmp) / "llama", LLAMA, dtype, device)
                label = "Llama shape (8 layers, d=512, MLP 2816, vocab 32000, random init)"
            else:
                parser.error(f"--shapes: unknown {shape!r} (builtin, llama)")
            print(f"== {label}, {args.new or NEW_TOKENS[shape]} new tokens ==")
            started = time.perf_counter()
            report(shape, measure(shape, name, device, args))
            print(f"    ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
