"""The `trio` command (also `python -m trio_widgets`).

`trio demo`: train DEFAULT_MODEL with a pipelined loop, headless.
`trio doctor`: check this environment; exit status 1 if a check FAILed.
`trio serve`: serve a pool over HTTP in Tinker's protocol until interrupted.
`trio pull-tokenizer`: store a served model's tokenizer in the Hugging Face cache.
`trio notebooks DIR`: copy the tutorial notebooks that ship with the package into DIR.
`trio --version`: the installed version (`trio_widgets.__version__`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import sysconfig
import threading
import time
from pathlib import Path

from . import DEFAULT_MODEL, AdamParams, APIFuture, ServiceClient, __version__
from .data import addition_batches
from .doctor import doctor
from .metrics import batch_weight, loss_per_token


async def pipelined_demo(seconds: float, min_cycle_s: float, batch_size: int, lr: float) -> dict:
    from .engine import LocalPool  # the engine extra (torch): `doctor` runs without it

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
    """Run the `trio` command line with `argv` (default: `sys.argv[1:]`); return its exit status.

    Example: `main(["doctor", "--json"])` prints the environment checks as JSON.
    """
    prog = "trio" if os.path.basename(sys.argv[0]) == "trio" else "python -m trio_widgets"
    parser = argparse.ArgumentParser(prog=prog, description="See and steer clock-cycle LoRA training.")
    parser.add_argument("--version", action="version", version=f"trio-widgets {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train DEFAULT_MODEL with a pipelined loop and print what happened")
    demo.add_argument("--seconds", type=float, default=30.0)
    demo.add_argument("--min-cycle-s", type=float, default=0.05)
    demo.add_argument("--batch-size", type=int, default=16)
    demo.add_argument("--lr", type=float, default=3e-3)
    check = sub.add_parser("doctor", help="check Python, torch, package versions, checkpoints and the GIL; "
                                          "exit 1 if a check FAILed")
    check.add_argument("--json", action="store_true", help="print the checks as a JSON list of records")
    serve = sub.add_parser("serve", help="serve a pool over HTTP in Tinker's wire protocol (the tinker SDK, "
                                          "trio.ServiceClient(base_url=...), trio.Dashboard(url)) until interrupted")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs keys)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model", action="append", default=None,
                       help=f"a base model clients may train (repeatable; default {DEFAULT_MODEL}); loaded at start")
    serve.add_argument("--api-key", action="append", default=[],
                       help="accept this API key (repeatable; it shows in `ps`: prefer --api-keys-file or "
                            "$TRIO_API_KEYS)")
    serve.add_argument("--api-keys-file", help="a file of API keys, one per line, each optionally followed by the "
                                               "participant's name ('tml-... Ada Lovelace': the dashboard's label "
                                               "for that key's sessions); also: $TRIO_API_KEYS, comma-separated")
    serve.add_argument("--observer-key", action="append", default=[],
                       help="a key that may also watch the whole pool (trio.Dashboard(url, api_key=...)); it shows "
                            "in `ps`: prefer --observer-keys-file or $TRIO_OBSERVER_KEYS")
    serve.add_argument("--observer-keys-file", help="a file of observer keys, one per line (also: "
                                                    "$TRIO_OBSERVER_KEYS, comma-separated)")
    serve.add_argument("--min-cycle-s", type=float, default=0.05)
    serve.add_argument("--checkpoint-dir", help="where checkpoints go (default: the user cache directory)")
    serve.add_argument("--session-timeout-s", type=float, default=60.0,
                       help="a session not heard from for this long is expired: its queued requests cancelled")
    serve.add_argument("--device", default="auto")
    serve.add_argument("--allowed-hosts", default="",
                       help="comma-separated host names clients reach this server by, besides IP addresses, "
                            "localhost and this machine's names (a page rebinding any other name is refused)")
    serve.add_argument("--allowed-origins", default="",
                       help="comma-separated web origins whose pages may call this server (default: none)")
    serve.add_argument("--ray", action="store_true",
                       help="serve a fleet of pools behind this one URL on Ray Serve (the cluster extra); "
                            "sessions are placed on the pool with the most headroom")
    serve.add_argument("--pools", type=int, default=2, help="with --ray: how many pools (default 2)")
    serve.add_argument("--gpus-per-pool", type=float, default=None,
                       help="with --ray: GPUs per pool (default: 1 where the cluster has GPUs, else CPU pools)")
    serve.add_argument("--cpus-per-pool", type=float, default=1.0,
                       help="with --ray: CPUs (and torch threads) per CPU pool (default 1)")
    serve.add_argument("--address", default=None,
                       help="with --ray: the Ray cluster (auto, or ray://head:10001; default: start a local one)")
    pull = sub.add_parser("pull-tokenizer", help="store a served model's tokenizer in this machine's Hugging Face "
                                                 "cache under the model's name (what a workshop participant runs "
                                                 "once: then AutoTokenizer.from_pretrained(MODEL) works offline)")
    pull.add_argument("model", nargs="?", help="the base model (default: the server's first)")
    pull.add_argument("--base-url", default=os.environ.get("TRIO_BASE_URL"),
                      help="the served pool (default: $TRIO_BASE_URL)")
    pull.add_argument("--api-key", default=None, help="a key of the server (default: $TRIO_API_KEY; it shows in "
                                                      "`ps`, so prefer the variable)")
    notebooks = sub.add_parser("notebooks", help="copy the tutorial notebooks that ship with the package into "
                                                 "a directory (default: ./trio-notebooks)")
    notebooks.add_argument("directory", nargs="?", default="trio-notebooks")
    args = parser.parse_args(argv)
    if args.command == "notebooks":
        return _copy_notebooks(Path(args.directory))
    if args.command == "serve":
        return _serve(args)
    if args.command == "pull-tokenizer":
        return _pull_tokenizer(args)
    if args.command == "doctor":
        report = doctor()
        print(json.dumps([dataclasses.asdict(r) for r in report.records], indent=1) if args.json else report)
        return 0 if report.ok else 1
    stats = asyncio.run(pipelined_demo(args.seconds, args.min_cycle_s, args.batch_size, args.lr))
    print(f"updates: {stats['updates']}")
    print(f"cycles per update: {stats['cycles_per_update']:.2f} (pipelined; naive would be 4)")
    print(f"loss per token: {stats['first_loss']:.3f} -> {stats['last_loss']:.3f}")
    return 0


def shipped_notebooks() -> Path | None:
    """The folder of the tutorial notebooks: the wheel's `share/trio-widgets/notebooks` under
    this environment's prefix, else a source checkout's `notebooks/` (an editable install)."""
    for folder in (Path(sysconfig.get_path("data")) / "share" / "trio-widgets" / "notebooks",
                   Path(__file__).resolve().parents[1] / "notebooks"):
        if any(folder.glob("*.ipynb")):
            return folder
    return None


def _copy_notebooks(target: Path) -> int:
    source = shipped_notebooks()
    if source is None:
        print("trio notebooks: no notebooks found in this installation (reinstall trio-widgets from its wheel)",
              file=sys.stderr)
        return 1
    target.mkdir(parents=True, exist_ok=True)
    existing = sorted(p.name for p in source.glob("*.ipynb") if (target / p.name).exists())
    if existing:  # a user's edited copy is theirs: never overwritten
        print(f"trio notebooks: {target} already has {', '.join(existing)}; remove them or choose another "
              "directory", file=sys.stderr)
        return 1
    names = sorted(p.name for p in source.glob("*.ipynb"))
    for name in names:
        shutil.copyfile(source / name, target / name)
    print(f"trio: copied {len(names)} notebooks to {target} (open them with `jupyter lab {target}`)")
    return 0


def _pull_tokenizer(args: argparse.Namespace) -> int:
    from .errors import UnknownModelError
    from .tokenizers import pull_tokenizer

    if not args.base_url:
        print("trio pull-tokenizer: give --base-url (or set $TRIO_BASE_URL) of the served pool", file=sys.stderr)
        return 2
    try:
        where = pull_tokenizer(args.base_url, args.api_key or os.environ.get("TRIO_API_KEY"), args.model)
    except (UnknownModelError, OSError) as exc:
        print(f"trio pull-tokenizer: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # httpx's transport errors: the server is not there
        print(f"trio pull-tokenizer: cannot reach {args.base_url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    model = where.parent.parent.name.removeprefix("models--").replace("--", "/")
    print(f"trio: the tokenizer of {model} is in {where}; AutoTokenizer.from_pretrained({model!r}) now loads it "
          f"(also with HF_HUB_OFFLINE=1)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .http.server import Server, check_bind, freeze_heap

    # the server's log on stderr: one line per refused or failed request, sessions expired
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    served = logging.getLogger("trio_widgets.http")
    served.addHandler(handler)
    served.setLevel(logging.INFO)

    # key -> the participant's name ("" if none): a keys file's line is "KEY" or "KEY Their Name"
    keys: dict[str, str] = dict.fromkeys(args.api_key, "")
    keys.update(dict.fromkeys((k.strip() for k in os.environ.get("TRIO_API_KEYS", "").split(",") if k.strip()), ""))
    if args.api_keys_file:
        with open(args.api_keys_file, encoding="utf-8") as f:
            for line in f:
                if line.strip() and not line.startswith("#"):
                    key, _, name = line.strip().partition(" ")
                    keys[key] = name.strip()
    if args.api_key or args.observer_key:  # (kept working, and said: a script may rely on them)
        print("trio serve: a key given on the command line shows in `ps` to every user of this machine; "
              "give keys in a file (--api-keys-file, --observer-keys-file) or the environment "
              "($TRIO_API_KEYS, $TRIO_OBSERVER_KEYS)", file=sys.stderr)
    observers = list(args.observer_key)
    observers += [k.strip() for k in os.environ.get("TRIO_OBSERVER_KEYS", "").split(",") if k.strip()]
    if args.observer_keys_file:
        with open(args.observer_keys_file, encoding="utf-8") as f:
            observers += [line.strip() for line in f if line.strip() and not line.startswith("#")]
    args.observer_key = observers
    try:
        check_bind(args.host, [*keys, *args.observer_key])  # before loading anything
    except ValueError as exc:
        print(f"trio serve: {exc}", file=sys.stderr)
        return 2
    models = args.model or [DEFAULT_MODEL]
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.ray:
        return _serve_fleet(args, keys, models, stop)
    from .engine import LocalPool

    pool = LocalPool(min_cycle_s=args.min_cycle_s, device=args.device, checkpoint_dir=args.checkpoint_dir,
                     name="served", owned_by_cell=False)
    for name in models:
        pool.get_base_model(name)
    server = Server(pool, host=args.host, port=args.port, api_keys=keys, observer_keys=args.observer_key,
                    models=models, session_timeout_s=args.session_timeout_s, owns_pool=True,
                    allowed_hosts=[h for h in args.allowed_hosts.split(",") if h.strip()],
                    allowed_origins=[o for o in args.allowed_origins.split(",") if o.strip()])
    try:
        server.start()
    except OSError as exc:
        pool.close()
        print(f"trio serve: {exc}", file=sys.stderr)
        return 1
    freeze_heap()
    print(f"trio: serving pool {pool.name!r} ({pool.device.type}, min cycle {pool.min_cycle_s * 1e3:.0f} ms) on "
          f"{server.url} - models: {', '.join(models)}; keys: {len(keys) or 'none (loopback only)'}", flush=True)
    stop.wait()
    server.stop()  # answers pending futures, releases every client, closes the pool
    print("trio: stopped", flush=True)
    return 0


def _serve_fleet(args: argparse.Namespace, keys: dict[str, str], models: list[str], stop: threading.Event) -> int:
    try:
        from .http.ray_fleet import serve_fleet
    except ImportError as exc:
        print(f"trio serve --ray: needs Ray Serve (pip install 'trio-widgets[cluster]'): {exc}", file=sys.stderr)
        return 2
    try:
        fleet = serve_fleet(args.pools, host=args.host, port=args.port, address=args.address,
                            gpus_per_pool=args.gpus_per_pool, cpus_per_pool=args.cpus_per_pool, models=models,
                            checkpoint_dir=args.checkpoint_dir, api_keys=keys, observer_keys=args.observer_key,
                            min_cycle_s=args.min_cycle_s, device=args.device,
                            session_timeout_s=args.session_timeout_s)
    except (ValueError, OSError) as exc:
        print(f"trio serve --ray: {exc}", file=sys.stderr)
        return 1
    from .http.server import freeze_heap

    # this process is the fleet's front door and nothing else: Ray's and our startup heap (~280,000
    # objects, a 0.2 s full collection with the GIL held) frozen, as each pool's replica does; a
    # merged listing's allocations set such passes off, and every request through the door waited
    # (issue 36: fleet heartbeats up to 220-310 ms while another key listed 2,000 checkpoints)
    freeze_heap()
    pools = f"{fleet.pools} pool{'s' if fleet.pools != 1 else ''}"
    print(f"trio: serving a fleet of {pools} on {fleet.url} (Ray Serve) - models: {', '.join(models)}; "
          f"checkpoints in {fleet.checkpoint_dir}; keys: {len(keys) or 'none (loopback only)'}", flush=True)
    stop.wait()
    fleet.stop()
    print("trio: stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
