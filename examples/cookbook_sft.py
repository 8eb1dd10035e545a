"""tinker-cookbook's supervised loop, unchanged, on a served trio pool (docs/cookbook.md).

`tinker_cookbook.supervised.train.main` trains a LoRA on chat conversations read by the
cookbook's own `FromConversationFileBuilder` (a JSONL file, one `{"messages": [...]}` per line),
rendered by its tokenizer-agnostic `role_colon` renderer, with rolling checkpoints and a
held-out NLL. Run it again with a larger ``--epochs`` and it resumes from the run's
``checkpoints.jsonl``. Without ``--data`` it writes a small demo file into the log directory
(the assistant repeats a word three times).

    TRIO_API_KEYS=tml-ada python -m trio_widgets serve --port 8000        # the pool
    TRIO_BASE_URL=http://127.0.0.1:8000 TRIO_API_KEY=tml-ada python -m trio_widgets pull-tokenizer
    export HF_HUB_OFFLINE=1 TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-ada
    python examples/cookbook_sft.py runs/sft                    # one epoch
    python examples/cookbook_sft.py runs/sft --epochs 2         # resumes for a second one

Needs Python >= 3.11 and tinker-cookbook (`make setup` installs requirements-cookbook.txt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

MODEL = "trio/tiny-llama-byte"  # the built-in model; its byte tokenizer works with role_colon
RENDERER = "role_colon"  # "User: ...\n\nAssistant: ...": needs no chat template
WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "piano", "lemon", "ocean", "candle", "garden",
         "rocket"]


def demo_conversations(n: int = 64) -> list[dict]:
    """The cookbook's conversation-file format: the assistant repeats the word three times."""
    return [{"messages": [{"role": "user", "content": f"Repeat: {word}"},
                          {"role": "assistant", "content": f"{word} {word} {word}"}]}
            for word in (WORDS[i % len(WORDS)] for i in range(n))]


def config(log_path: str, data: str, epochs: int) -> train.Config:
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=MODEL, renderer_name=RENDERER,
                                            max_length=128, batch_size=8)
    return train.Config(
        log_path=log_path, model_name=MODEL, recipe_name="trio_cookbook_sft", renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(file_path=data, test_size=8, common_config=common),
        learning_rate=5e-3, lora_rank=8, num_epochs=epochs,
        save_every=0, rolling_save_every=2, eval_every=3, infrequent_eval_every=0,
    )  # base_url: None, so the SDK reads $TINKER_BASE_URL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_path", help="the run's directory (metrics.jsonl, checkpoints.jsonl, logs.log)")
    parser.add_argument("--data", help="a JSONL file of conversations (default: a demo file in the log directory)")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the data (more than before: resume)")
    args = parser.parse_args()
    data = args.data
    if data is None:
        demo = Path(args.log_path) / "conversations.jsonl"
        if not demo.exists():
            demo.parent.mkdir(parents=True, exist_ok=True)
            demo.write_text("".join(json.dumps(row) + "\n" for row in demo_conversations()), encoding="utf-8")
        data = str(demo)
    asyncio.run(train.main(config(args.log_path, data, args.epochs)))


if __name__ == "__main__":
    main()
