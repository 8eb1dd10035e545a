"""tinker-cookbook's RL loop, unchanged, on a served trio pool, with an environment of our own
written against its `rl.types` API (docs/cookbook.md).

The environment asks for a letter; the policy answers with one byte and is rewarded 1 for a
lowercase ASCII letter (about 10% of bytes for the random-init built-in model, ~1.0 after
some 8 updates). `tinker_cookbook.rl.train.main` samples groups of 8, centres the rewards in
each group and trains with its importance-sampling loss. At this learning rate Adam can
overshoot: one step in a run may dip (even from 1.0, when its momentum carries on through
zero-advantage steps) before the next steps climb back.

    TRIO_API_KEYS=tml-ada python -m trio_widgets serve --port 8000        # the pool
    TRIO_BASE_URL=http://127.0.0.1:8000 TRIO_API_KEY=tml-ada python -m trio_widgets pull-tokenizer
    export HF_HUB_OFFLINE=1 TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-ada
    python examples/cookbook_rl.py runs/rl --steps 14    # env/all/reward/total per step in runs/rl/metrics.jsonl

Needs Python >= 3.11 and tinker-cookbook (`make setup` installs requirements-cookbook.txt).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import chz
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.rl import train, types
from tinker_cookbook.tokenizer_utils import get_tokenizer

MODEL = "trio/tiny-llama-byte"
RENDERER = "role_colon"
REWARDED = frozenset(b"abcdefghijklmnopqrstuvwxyz")


class SayALetter(types.Env):
    """One turn: "Say a letter."; the answer (one token: one byte) earns 1 if it is a-z."""

    def __init__(self, renderer: renderers.Renderer):
        self.renderer = renderer

    async def initial_observation(self) -> tuple[types.Observation, types.StopCondition]:
        prompt = self.renderer.build_generation_prompt([{"role": "user", "content": "Say a letter."}])
        return prompt, self.renderer.get_stop_sequences()

    async def step(self, action: types.Action, *, extra: types.ActionExtra | None = None) -> types.StepResult:
        said = self.renderer.tokenizer.decode(action).encode()
        hit = len(said) == 1 and said[0] in REWARDED
        return types.StepResult(reward=1.0 if hit else 0.0, episode_done=True,
                                next_observation=tinker.ModelInput.empty(), next_stop_condition=[],
                                metrics={"letter": float(hit)})


@dataclass(frozen=True)
class SayALetterGroup(types.EnvGroupBuilder):
    """A group of environments whose rewards the loop centres (picklable: names, not objects)."""

    renderer_name: str
    group_size: int

    async def make_envs(self) -> Sequence[types.Env]:
        renderer = renderers.get_renderer(self.renderer_name, get_tokenizer(MODEL))
        return [SayALetter(renderer) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["say_a_letter"]


class SayALetterDataset(types.RLDataset):
    def __init__(self, batches: int, groups: int, group_size: int):
        self.batches, self.groups, self.group_size = batches, groups, group_size

    def get_batch(self, index: int) -> Sequence[types.EnvGroupBuilder]:
        return [SayALetterGroup(RENDERER, self.group_size) for _ in range(self.groups)]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class SayALetterBuilder(types.RLDatasetBuilder):
    batches: int
    groups: int = 8
    group_size: int = 8

    async def __call__(self) -> tuple[types.RLDataset, types.RLDataset | None]:
        return SayALetterDataset(self.batches, self.groups, self.group_size), None


def config(log_path: str, steps: int) -> train.Config:
    return train.Config(
        log_path=log_path, model_name=MODEL, recipe_name="trio_cookbook_rl", renderer_name=RENDERER,
        dataset_builder=SayALetterBuilder(batches=steps), learning_rate=1e-2, max_tokens=1, lora_rank=8,
        eval_every=0, save_every=0,
    )  # base_url: None, so the SDK reads $TINKER_BASE_URL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_path", help="the run's directory (metrics.jsonl, checkpoints.jsonl, logs.log)")
    parser.add_argument("--steps", type=int, default=14, help="updates (each: 8 groups of 8 samples)")
    args = parser.parse_args()
    asyncio.run(train.main(config(args.log_path, args.steps)))


if __name__ == "__main__":
    main()
