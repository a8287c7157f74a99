"""A scripted model for the agent-episode tests, in this process or as a worker process.

`ScriptedEngine` is the real HF engine (its model, weight loads and versions) whose model turns
are the test's: `SCRIPT` maps a user question to the model's turns in order, each encoded as the
tokenizer encodes it and ended with `<|im_end|>`. `build_chat_model` writes a tiny random Qwen2
over the ChatML test tokenizer's vocabulary (`tests.chat_templates`).

    python -m tests.episode_script --run R --nats URL
        a rollout worker (the production stage, `consumers.rollout.rollout_stage`) over a
        ScriptedEngine of the run config's `model.path`: what a test kills at a crash point
        (`JETRL_CRASH_AT`) and starts again.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from bus.runtime import Runtime
from bus.stage import Stage, run_stage
from consumers.rollout import Rollout, rollout_stage
from engines.hf_rollout import HFRolloutEngine
from engines.protocols import Sample, SamplingParams
from schemas import PromptEvent
from schemas import SamplingParams as PromptSampling
from tests.chat_templates import CHATML_TOOLS, chat_tokenizer

QUESTION = "What is 17 plus 25? Use the calculator."
ADD = "tests.agent_tools:add"
FNS = "tests.tool_runner_fns"
CALL = '<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def call(name: str, arguments: str = "{}") -> str:
    return CALL.format(name=name, arguments=arguments)


DURABLE = "What is 17 plus 25? Check your answer."
ASK = "What is 17 plus 25? Ask the calculator."
THINK = "What is 17 plus 25? Think first."
THOUGHT = "Let me think about it: seventeen and twenty five make forty two."
SCRIPT = {
    # the user's question -> the model's turns, in order
    DURABLE: [
        "I think it is 42",  # the environment (AskAgain) asks "Are you sure?"
        call("add", '{"a": 17, "b": 25}'),
        "the calculator says 42",
    ],
    ASK: [call("add", '{"a": 17, "b": 25}'), "the calculator says 42"],
    QUESTION: [
        call("add", '{"a": 17, "b": 25}'),
        "the calculator says 42",
        "so the answer is 42",
    ],
    "hang": [call("hang", '{"seconds": 60}')],
    "segfault": [call("segfault")],
    "big_result": [call("big_result")],
    "ramble": ["the calculator says 42", "so the answer is 42 " * 20],
    # A reasoning turn: a template that strips earlier `<think>` splits the episode after it.
    THINK: [f"<think>{THOUGHT}</think>\nI think it is 42", "the calculator says 42"],
}


def scripted_turn(text: str) -> tuple[str, int]:
    """What the model says next in the conversation `text` (rendered), and which turn it is."""
    turn = text.count("<|im_start|>assistant") - 1
    question = next(q for q in SCRIPT if f"<|im_start|>user\n{q}<|im_end|>" in text)
    turns = SCRIPT[question]
    return (turns[turn] if turn < len(turns) else "I do not know"), turn


class ScriptedEngine(HFRolloutEngine):
    """The real HF engine whose generations are scripted: each model turn is `scripted_turn`'s
    text as the tokenizer encodes it, then `<|im_end|>`; log-prob -0.5 - turn for each token."""

    def __init__(self, model_dir: Path, tokenizer: PreTrainedTokenizerFast) -> None:
        super().__init__(model_dir, seed=0)
        self.tokenizer = tokenizer

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        out = []
        for prompt in prompts:
            text, turn = scripted_turn(str(self.tokenizer.decode(list(prompt))))
            ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.eos_token_ids[0]]
            cut = len(ids) > params.max_tokens  # the engine stops at the limit, no end of turn
            ids = ids[: params.max_tokens]
            sample = Sample(
                torch.tensor(ids),
                torch.full((len(ids),), -0.5 - turn),
                finish_reason="length" if cut else "stop",
            )
            out.append([sample] * n)
        return out


def question(run: str, index: int, text: str, n: int) -> PromptEvent:
    """Prompt `index` of `run`: `text` as the user's message (and as `task["question"]`), n
    episodes of model turns of at most 64 tokens."""
    return PromptEvent(
        id=f"{run}/0/{index}",
        run=run,
        epoch=0,
        index=index,
        messages=({"role": "user", "content": text},),
        task={"question": text},
        n=n,
        sampling=PromptSampling(max_tokens=64),
    )


def build_chat_model(out: Path) -> tuple[Path, PreTrainedTokenizerFast]:
    """A tiny random Qwen2 over the ChatML test tokenizer's vocabulary in `out`, and that
    tokenizer (built, not saved: `chat_tokenizer` makes the same one each time)."""
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(out)
    return out, tokenizer


async def build(rt: Runtime) -> Stage[PromptEvent]:
    model_dir = rt.config.model.path
    assert model_dir is not None
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    engine = ScriptedEngine(Path(model_dir), tokenizer)
    return rollout_stage(Rollout(rt, engine, tokenizer))


if __name__ == "__main__":
    run_stage("rollout", build, "a rollout worker over a scripted model (tests)")
