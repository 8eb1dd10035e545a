"""Capacity of one LocalPool on this machine: cycle time and memory as tenants grow.

One pool (min_cycle_s=0, DEFAULT_MODEL, 1 torch thread unless --threads) trains, for each
LoRA rank in 8, 16, 64 and each count of tenants in 1, 2, 4, ..., 64, that many training
clients at once. Every client queues --cycles one-datum updates (forward_backward on 1
sequence of 64 random tokens, cross-entropy, then optim_step) in one held moment, so each
cycle packs one update of every tenant (64 tenants x 64 tokens = the default 4,096
max_tokens_per_pass: one pass). Per step it reports, from the pool's telemetry
(`pool.telemetry.cycles`), the median cycle time (ended_at - started_at) and busy time
(busy_s) over the cycles after --warmup; the process RSS while the clients are live and its
growth over the empty pool (base model loaded, one warm-up client trained and closed); the
adapter + gradient + AdamW state the pool reports per client (`ModelHandle.state_bytes`);
and the RSS once every client of the step is closed (memory must come back), before and
after glibc's `malloc_trim(0)` (each step starts trimmed), to tell memory the pool still
holds from freed memory the C allocator has not yet given back to the OS. On CUDA the table
shows torch's GPU memory (allocated with the clients live, and the step's peak) instead.

Prints a markdown table (the one docs/scaling.md shows) and draws the curve as a PNG with
Pillow (a dependency of bokeh; matplotlib is not one of this project's packages).

`--activations` measures instead what one packed training pass keeps for its backward per
token (autograd's saved tensors, the frozen base weights left out), with this engine's own
pass code at the real widths of Qwen2.5-0.5B and Llama-3.1-8B (shapes from their published
config.json; random weights, 1 and then 2 layers: the difference is one layer, the rest the
embedding, head and loss); docs/scaling.md turns it into GPU arithmetic. About a minute and
3 GB of RAM.

    .venv/bin/python benchmarks/scaling.py                 # 1-1.5 minutes on 2 shared CPU cores
    .venv/bin/python benchmarks/scaling.py --quick         # rank 8, tenants 1-8: under 10 s
    .venv/bin/python benchmarks/scaling.py --out docs/scaling.png --threads 2
    .venv/bin/python benchmarks/scaling.py --activations   # saved bytes per token, real widths
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import math
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch

import trio_widgets as trio
from trio_widgets.engine.models import resolve_device, usable_cpus

RANKS = (8, 16, 64)
TENANTS = (1, 2, 4, 8, 16, 32, 64)
LENGTH = 64  # tokens of the one datum each client sends per update
ADAM = trio.AdamParams(learning_rate=1e-4)
MB = 2**20


def rss_mb() -> float:
    gc.collect()
    return psutil.Process(os.getpid()).memory_info().rss / MB


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name is not None else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


LIBC = _libc()


def malloc_trim() -> bool:
    """Ask glibc to give freed heap memory back to the OS; False where there is no glibc."""
    if LIBC is None:
        return False
    LIBC.malloc_trim(0)
    return True


def datum(seed: int, vocab: int = 259) -> trio.Datum:
    """One sequence of LENGTH random byte tokens (ids 3..vocab-1: past the byte tokenizer's specials)."""
    rng = random.Random(seed)
    tokens = [rng.randrange(3, vocab) for _ in range(LENGTH + 1)]
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})


@dataclass
class Step:
    rank: int
    tenants: int
    tokens: int  # per cycle
    cycle_ms: float  # medians over the measured cycles
    busy_ms: float
    cpu_ms: float
    rss_mb: float  # with the clients live, after their cycles
    growth_mb: float  # over the empty pool
    state_mb: float  # what the pool reports holding for the clients (sum of state_bytes)
    closed_mb: float  # RSS once every client of the step is closed
    trimmed_mb: float  # ... and glibc has given its freed heap back (malloc_trim)
    gpu_mb: float = float("nan")  # on CUDA: torch's allocated memory with the clients live
    gpu_peak_mb: float = float("nan")  # ... and its peak during the step


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the pool did not get there in time")
        time.sleep(0.01)


def run_step(pool: trio.LocalPool, rank: int, tenants: int, warmup: int, cycles: int, empty_mb: float) -> Step:
    malloc_trim()  # what the previous step freed goes back to the OS: each step starts from the empty pool
    service = trio.ServiceClient(pool)
    clients = [service.create_lora_training_client(trio.DEFAULT_MODEL, rank=rank, seed=i) for i in range(tenants)]
    # the pool's own account of each client's adapter, gradient and two AdamW moments
    state_bytes = sum(tc._handle.state_bytes for tc in clients)
    batches = [[datum(1000 * i + k)] for i in range(tenants) for k in range(warmup + cycles)]
    cuda = pool.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(pool.device)
    first = pool.cycle_index
    futures: list[Any] = []  # forward_backward and optim_step futures
    with pool.hold():  # every update queued before the next boundary: cycle k takes update k of every client
        for k in range(warmup + cycles):
            for i, tc in enumerate(clients):
                futures.append(tc.forward_backward(batches[i * (warmup + cycles) + k], "cross_entropy"))
                futures.append(tc.optim_step(ADAM))
    for f in futures:
        f.result()
    live_mb = rss_mb()
    gpu = (torch.cuda.memory_allocated(pool.device) / MB, torch.cuda.max_memory_allocated(pool.device) / MB) \
        if cuda else (float("nan"), float("nan"))
    busy = [c for c in pool.telemetry.cycles if c.index >= first and c.n_requests > 0]
    assert len(busy) == warmup + cycles and all(c.n_requests == 2 * tenants for c in busy), \
        [c.n_requests for c in busy]
    measured = busy[warmup:]
    for tc in clients:
        tc.close()
    del clients, futures, batches
    wait_until(lambda: pool.tenant_count == 0)
    closed_mb = rss_mb()
    return Step(rank=rank, tenants=tenants, tokens=measured[0].tokens,
                cycle_ms=1e3 * statistics.median(c.ended_at - c.started_at for c in measured),
                busy_ms=1e3 * statistics.median(c.busy_s for c in measured),
                cpu_ms=1e3 * statistics.median(c.cpu_s for c in measured),
                rss_mb=live_mb, growth_mb=live_mb - empty_mb, state_mb=state_bytes / MB, closed_mb=closed_mb,
                trimmed_mb=rss_mb() if malloc_trim() else float("nan"), gpu_mb=gpu[0], gpu_peak_mb=gpu[1])


def table(steps: list[Step]) -> str:
    if any(not math.isnan(s.gpu_mb) for s in steps):  # on CUDA: torch's GPU memory first
        lines = ["| rank | tenants | tokens / cycle | cycle (ms) | busy (ms) | GPU allocated (MB) | GPU peak (MB) "
                 "| LoRA + grad + AdamW state (MB) | RSS (MB) |", "| ---: " * 9 + "|"]
        for s in steps:
            lines.append(f"| {s.rank} | {s.tenants} | {s.tokens:,} | {s.cycle_ms:.1f} | {s.busy_ms:.1f} "
                         f"| {s.gpu_mb:.0f} | {s.gpu_peak_mb:.0f} | {s.state_mb:.1f} | {s.rss_mb:.0f} |")
        return "\n".join(lines)
    lines = ["| rank | tenants | tokens / cycle | cycle (ms) | busy (ms) | clock CPU (ms) | ms per tenant "
             "| RSS (MB) | + over empty pool (MB) | LoRA + grad + AdamW state (MB) | RSS after close (MB) "
             "| ... and malloc_trim (MB) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in steps:
        lines.append(f"| {s.rank} | {s.tenants} | {s.tokens:,} | {s.cycle_ms:.1f} | {s.busy_ms:.1f} | {s.cpu_ms:.1f} "
                     f"| {s.cycle_ms / s.tenants:.1f} | {s.rss_mb:.0f} | {s.growth_mb:+.0f} | {s.state_mb:.1f} "
                     f"| {s.closed_mb:.0f} | {s.trimmed_mb:.0f} |")
    return "\n".join(lines)


# -- the PNG (Pillow) ---------------------------------------------------------------------------

COLOURS = {8: (31, 119, 180), 16: (255, 127, 14), 64: (44, 160, 44)}


def nice_step(span: float) -> float:
    """A tick step of 1, 2 or 5 times a power of ten that cuts `span` into at most 6 parts."""
    power = 10 ** math.floor(math.log10(span / 6)) if span > 0 else 1.0
    return next(m * power for m in (1, 2, 5, 10) if span / (m * power) <= 6)


def draw_png(steps: list[Step], path: str, title: str) -> None:
    from PIL import Image, ImageDraw, ImageFont

    width, height, pad = 1200, 520, 70
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font, small = ImageFont.load_default(size=16), ImageFont.load_default(size=13)
    draw.text((pad, 12), title, fill="black", font=font)
    tenants = sorted({s.tenants for s in steps})
    ranks = sorted({s.rank for s in steps})
    panels = [("cycle time (ms, median)", lambda s: s.cycle_ms, None),
              ("memory over the empty pool (MB): RSS solid, LoRA+grad+AdamW state dashed",
               lambda s: s.growth_mb, lambda s: s.state_mb)]
    panel_w = (width - 3 * pad) // 2
    for p, (label, value, second) in enumerate(panels):
        x0, y0, x1, y1 = pad + p * (panel_w + pad), 60, pad + p * (panel_w + pad) + panel_w, height - pad
        values = [value(s) for s in steps] + ([second(s) for s in steps] if second else [])
        tick = nice_step(max(values) - min(0.0, min(values)))
        top = math.ceil(max(values) / tick) * tick or tick
        bottom = min(0.0, math.floor(min(values) / tick) * tick)

        def at(t: int, v: float, x0: int = x0, x1: int = x1, y0: int = y0, y1: int = y1,
               top: float = top, bottom: float = bottom) -> tuple[float, float]:
            i = tenants.index(t) / max(1, len(tenants) - 1)  # log2 spacing: the counts double
            return x0 + i * (x1 - x0), y1 - (v - bottom) / (top - bottom) * (y1 - y0)

        draw.rectangle((x0, y0, x1, y1), outline=(90, 90, 90))
        draw.text((x0, y0 - 22), label, fill="black", font=small)
        for t in tenants:
            x, _ = at(t, bottom)
            draw.line((x, y1, x, y1 + 5), fill=(90, 90, 90))
            draw.text((x - 6, y1 + 8), str(t), fill="black", font=small)
        draw.text(((x0 + x1) // 2 - 60, y1 + 28), "tenants (log scale)", fill="black", font=small)
        for k in range(round((top - bottom) / tick) + 1):
            v = bottom + k * tick
            _, y = at(tenants[0], v)
            draw.line((x0 - 5, y, x0, y), fill=(90, 90, 90))
            draw.line((x0, y, x1, y), fill=(235, 235, 235))
            draw.text((x0 - 52, y - 7), f"{v:,.0f}", fill="black", font=small)
        for r in ranks:
            mine = sorted((s for s in steps if s.rank == r), key=lambda s: s.tenants)
            colour = COLOURS.get(r, (120, 120, 120))
            points = [at(s.tenants, value(s)) for s in mine]
            draw.line(points, fill=colour, width=3)
            for x, y in points:
                draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=colour)
            if second:
                dashed = [at(s.tenants, second(s)) for s in mine]
                for (xa, ya), (xb, yb) in zip(dashed, dashed[1:]):
                    for j in range(0, 10, 2):  # five dashes per segment
                        draw.line((xa + (xb - xa) * j / 10, ya + (yb - ya) * j / 10,
                                   xa + (xb - xa) * (j + 1) / 10, ya + (yb - ya) * (j + 1) / 10), fill=colour, width=2)
        for n, r in enumerate(ranks):
            colour = COLOURS.get(r, (120, 120, 120))
            draw.line((x0 + 12, y0 + 16 + 20 * n, x0 + 36, y0 + 16 + 20 * n), fill=colour, width=3)
            draw.text((x0 + 42, y0 + 8 + 20 * n), f"rank {r}", fill="black", font=small)
    image.save(path)

# -- --activations: saved-for-backward bytes per token at real model widths ----------------------

SHAPES: dict[str, tuple[str, dict[str, int], int]] = {  # name: (dtype, LlamaConfig shape, layers)
    trio.DEFAULT_MODEL: ("float32", dict(hidden_size=128, intermediate_size=384, num_attention_heads=4,
                                         num_key_value_heads=4, vocab_size=259), 4),
    "Qwen2.5-0.5B shape": ("bfloat16", dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                                            num_key_value_heads=2, vocab_size=151936), 24),
    "Llama-3.1-8B shape": ("bfloat16", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                            num_key_value_heads=8, vocab_size=128256), 32),
}


def saved_bytes(shape: dict[str, int], layers: int, dtype: torch.dtype, tenants: int, length: int) -> int:
    """Bytes autograd keeps for the backward of one packed pass of `tenants` x `length` tokens
    (rank 16, every linear targeted), the frozen base weights left out."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trio_widgets.engine.compute import _run_pass, _Work, make_forward_job
    from trio_widgets.engine.lora import LoRAAdapter
    from trio_widgets.engine.models import BaseModel, _install_lora_wrappers
    from trio_widgets.engine.packing import ATTN_IMPLEMENTATION, register_attention

    register_attention()
    settings: dict[str, Any] = dict(shape, num_hidden_layers=layers, max_position_embeddings=512,
                                    tie_word_embeddings=False)
    config = LlamaConfig(**settings)
    with torch.device("meta"):
        model: Any = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.requires_grad_(False)
    model.eval()
    model.config.use_cache = False
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    targets = _install_lora_wrappers(model)
    base = BaseModel(name="probe", model=model, tokenizer=None, vocab_size=shape["vocab_size"], context_length=512,
                     device=torch.device("cpu"), dtype=dtype, lora_targets=targets, source="probe")
    works = []
    for i in range(tenants):
        adapter = LoRAAdapter(base.targets_for(True, True, True), 16, seed=i, device=base.device)
        rng = random.Random(i)
        tokens = [rng.randrange(3, 250) for _ in range(length + 1)]
        one = trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]),
                         loss_fn_inputs={"target_tokens": tokens[1:]})
        works.append(_Work(adapter=adapter, job=make_forward_job(base, [one], "cross_entropy", {}, True)[0],
                           client_id=f"probe-{i}"))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _run_pass(base, works, 1 << 20, True)
    frozen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in saved.items() if ptr not in frozen)


def activations(threads: int) -> None:
    torch.set_num_threads(threads)
    print("| shape (dtype) | layers | KiB per token per layer | KiB per token, embedding + head + loss "
          "| MiB per token, whole model |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (dtype_name, shape, layers) in SHAPES.items():
        tenants, length = (4, 16) if shape["hidden_size"] >= 4096 else (4, 64)
        one, two = (saved_bytes(shape, n, getattr(torch, dtype_name), tenants, length) / (tenants * length) / 1024
                    for n in (1, 2))
        per_layer, rest = two - one, 2 * one - two
        print(f"| {name} ({dtype_name}) | {layers} | {per_layer:,.1f} | {rest:,.1f} "
              f"| {(rest + layers * per_layer) / 1024:,.2f} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="rank 8 only, tenants 1-8")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of the pool (default 1)")
    parser.add_argument("--warmup", type=int, default=2, help="cycles per step left out of the medians")
    parser.add_argument("--cycles", type=int, default=5, help="cycles per step measured")
    parser.add_argument("--max-tenants", type=int, default=64)
    parser.add_argument("--out", default="docs/scaling.png", help="the PNG to write ('' for none)")
    parser.add_argument("--activations", action="store_true",
                        help="only measure saved-for-backward bytes per token at real model widths")
    args = parser.parse_args()
    if args.activations:
        activations(args.threads)
        return 0
    ranks = (8,) if args.quick else RANKS
    counts = [t for t in TENANTS if t <= (8 if args.quick else args.max_tenants)]

    load = os.getloadavg()
    device = resolve_device("auto")
    start_mb = rss_mb()
    t0 = time.perf_counter()
    pool = trio.LocalPool(min_cycle_s=0.0, torch_threads=args.threads, name="bench-scaling")
    header = (f"torch {torch.__version__}, device {device}, {usable_cpus()} usable CPU(s), {torch.get_num_threads()} "
              f"torch thread(s); {trio.DEFAULT_MODEL}; 1 datum x {LENGTH} tokens per client per cycle "
              f"(forward_backward + optim_step); medians of {args.cycles} cycles after {args.warmup}; "
              f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before")
    print(header, flush=True)
    try:
        pool.get_base_model(trio.DEFAULT_MODEL)
        loaded_mb = rss_mb()
        run_step(pool, 8, 1, 2, 2, loaded_mb)  # warm-up: first-pass allocations, kernels
        malloc_trim()
        empty_mb = rss_mb()
        print(f"RSS: {start_mb:.0f} MB at start, {loaded_mb:.0f} MB with the pool and base model, "
              f"{empty_mb:.0f} MB empty pool after a warm-up client (the baseline)", flush=True)
        steps: list[Step] = []
        for rank in ranks:
            for tenants in counts:
                step = run_step(pool, rank, tenants, args.warmup, args.cycles, empty_mb)
                steps.append(step)
                print(f"  rank {rank:2} x {tenants:2} tenants: cycle {step.cycle_ms:7.1f} ms, RSS {step.rss_mb:6.0f} "
                      f"MB ({step.growth_mb:+.0f}), state {step.state_mb:6.1f} MB, after close "
                      f"{step.closed_mb:.0f} MB, trimmed {step.trimmed_mb:.0f} MB", flush=True)
            closed = rss_mb()
            trimmed = rss_mb() if malloc_trim() else float("nan")
            print(f"  rank {rank}: every client closed: RSS {closed:.0f} MB ({closed - empty_mb:+.0f} over the empty "
                  f"pool); after malloc_trim(0) {trimmed:.0f} MB ({trimmed - empty_mb:+.0f})", flush=True)
    finally:
        pool.close()
    print(f"({time.perf_counter() - t0:.0f} s)\n")
    print(table(steps))
    if args.out:
        draw_png(steps, args.out, f"One LocalPool, {trio.DEFAULT_MODEL}, {torch.get_num_threads()} torch thread(s), "
                                  f"1 x {LENGTH} tokens per tenant per cycle")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
