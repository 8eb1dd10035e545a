"""`python -m trio_widgets demo`: train DEFAULT_MODEL with a pipelined loop, headless.
`python -m trio_widgets doctor`: check this environment; exit status 1 if a check FAILed."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time

from . import DEFAULT_MODEL, AdamParams, APIFuture, LocalPool, ServiceClient
from .data import addition_batches
from .doctor import doctor
from .metrics import batch_weight, loss_per_token


async def pipelined_demo(seconds: float, min_cycle_s: float, batch_size: int, lr: float) -> dict:
    with LocalPool(min_cycle_s=min_cycle_s) as pool:
        tc = ServiceClient(pool).create_lora_training_client(DEFAULT_MODEL, rank=16, seed=0)
        batches = addition_batches(tc.get_tokenizer(), batch_size=batch_size, seed=0)
        adam = AdamParams(learning_rate=lr)
        losses, fb_cycles = [], []
        in_flight: list[tuple[APIFuture, APIFuture, float]] = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or in_flight:
            if time.perf_counter() < deadline:
                batch = next(batches)
                # Queue the next update before awaiting the current one: one update per cycle.
                fb = await tc.forward_backward_async(batch, "cross_entropy")
                opt = await tc.optim_step_async(adam)
                in_flight.append((fb, opt, batch_weight(batch)[0]))
                if len(in_flight) < 2:
                    continue
            prev_fb, prev_opt, weight = in_flight.pop(0)
            result = await prev_fb
            await prev_opt
            losses.append(loss_per_token(result.metrics["loss:sum"], weight))
            if prev_fb.cycle is not None:
                fb_cycles.append(prev_fb.cycle)
    steady = fb_cycles[len(fb_cycles) // 4:]
    period = (steady[-1] - steady[0]) / max(1, len(steady) - 1)
    return {"updates": len(losses), "cycles_per_update": period, "first_loss": losses[0], "last_loss": losses[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trio_widgets")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train DEFAULT_MODEL with a pipelined loop and print what happened")
    demo.add_argument("--seconds", type=float, default=30.0)
    demo.add_argument("--min-cycle-s", type=float, default=0.05)
    demo.add_argument("--batch-size", type=int, default=16)
    demo.add_argument("--lr", type=float, default=3e-3)
    check = sub.add_parser("doctor", help="check Python, torch, package versions, checkpoints and the GIL; "
                                          "exit 1 if a check FAILed")
    check.add_argument("--json", action="store_true", help="print the checks as a JSON list of records")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        report = doctor()
        print(json.dumps([dataclasses.asdict(r) for r in report.records], indent=1) if args.json else report)
        return 0 if report.ok else 1
    stats = asyncio.run(pipelined_demo(args.seconds, args.min_cycle_s, args.batch_size, args.lr))
    print(f"updates: {stats['updates']}")
    print(f"cycles per update: {stats['cycles_per_update']:.2f} (pipelined; naive would be 4)")
    print(f"loss per token: {stats['first_loss']:.3f} -> {stats['last_loss']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
