"""The tiny model, the HF rollout engine and the torch train engine, on CPU."""

import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.device import DEVICE_ENV, resolve_device, with_index
from engines.hf_rollout import HFRolloutEngine, _top_p_filter
from engines.protocols import MicroBatch, RolloutEngine, Sample, SamplingParams, TrainEngine
from engines.torch_train import LossConfig, TorchTrainEngine
from producers import tasks

TEMPERATURE = 0.7  # not 1, so that both engines must apply it the same way


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):  # noqa: ANN201 - whatever class AutoTokenizer picks
    return AutoTokenizer.from_pretrained(model_dir)


def trainer(model_dir: Path, **loss: object) -> TorchTrainEngine:
    config = LossConfig(temperature=TEMPERATURE, **loss)  # type: ignore[arg-type]
    return TorchTrainEngine(model_dir, lr=1e-2, weight_decay=0.01, seed=0, loss=config)


def prompts(tokenizer, count: int) -> list[list[int]]:  # noqa: ANN001
    return [tokenizer(tasks.task_record("digits", i)["prompt"]).input_ids for i in range(count)]


def collate(prompt_ids: Sequence[Sequence[int]], groups: list[list[Sample]]) -> MicroBatch:
    """Right-padded rows prompt + response, advantages +-1 alternating."""
    rows = [(list(p), s) for p, group in zip(prompt_ids, groups, strict=True) for s in group]
    width = max(len(p) + len(s.token_ids) for p, s in rows)
    batch = MicroBatch(
        input_ids=torch.zeros(len(rows), width, dtype=torch.long),
        attention_mask=torch.zeros(len(rows), width, dtype=torch.long),
        loss_mask=torch.zeros(len(rows), width),
        advantages=torch.tensor([(-1.0) ** i for i in range(len(rows))]),
        behaviour_logprobs=torch.zeros(len(rows), width),
    )
    for i, (prompt, sample) in enumerate(rows):
        start, end = len(prompt), len(prompt) + len(sample.token_ids)
        batch.input_ids[i, :end] = torch.cat([torch.tensor(prompt), sample.token_ids])
        batch.attention_mask[i, :end] = 1
        batch.loss_mask[i, start:end] = 1
        batch.behaviour_logprobs[i, start:end] = sample.logprobs
    return batch


# ---- the tiny model ----------------------------------------------------------------------


def test_tiny_model_loads_through_the_auto_classes(model_dir: Path, tokenizer) -> None:  # noqa: ANN001
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tokenizer) == len(tasks.VOCAB)
    ids = tokenizer("i3149=").input_ids
    assert ids == [tasks.VOCAB.index(ch) for ch in "i3149="]
    # The light tokenizer a producer would use agrees with the AutoTokenizer one.
    assert Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode("i3149=").ids == ids
    eos = tokenizer.eos_token_id
    assert tokenizer.decode([*ids[1:5], eos], skip_special_tokens=True) == "3149"
    assert tokenizer.pad_token_id == eos == model.generation_config.eos_token_id


def test_tasks_are_deterministic_and_scored_by_position() -> None:
    first = tasks.task_record("digits", 7, seed=3)
    assert first == tasks.task_record("digits", 7, seed=3)
    record = tasks.task_record("increment", 0)
    letter, rest = record["prompt"][0], record["prompt"][1:-1]
    assert letter == "i" and record["task"]["target"] == "".join(
        str((int(d) + 1) % 10) for d in rest
    )
    task = {"target": "4250"}
    assert tasks.score_digits("4250", task) == 1.0
    assert tasks.score_increment("4 2 5 0", task) == 1.0  # spaces from a decoder are ignored
    assert tasks.score_copy("4299", task) == 0.5
    assert tasks.score_reverse("425000", task) == 4 / 6  # rambling past the answer costs
    assert tasks.score_digits("", task) == 0.0


# ---- rollout -----------------------------------------------------------------------------


def test_generation_shapes_and_logprobs_match_a_forward_pass(model_dir: Path, tokenizer) -> None:  # noqa: ANN001
    engine = HFRolloutEngine(model_dir, seed=0)
    assert isinstance(engine, RolloutEngine)
    # Prompts of different lengths exercise the left padding.
    prompt_ids = [*prompts(tokenizer, 2), [tasks.VOCAB.index("c"), tasks.VOCAB.index("=")]]
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=tasks.MAX_RESPONSE_TOKENS)
    groups = engine.generate(prompt_ids, n=4, params=params)
    assert [len(g) for g in groups] == [4, 4, 4]
    for sample in (s for g in groups for s in g):
        assert sample.token_ids.dtype == torch.long and sample.logprobs.dtype == torch.float32
        assert 1 <= len(sample.token_ids) == len(sample.logprobs) <= params.max_tokens
        assert bool((sample.logprobs <= 0).all())
        stopped = int(sample.token_ids[-1]) == tokenizer.eos_token_id
        assert sample.finish_reason == ("stop" if stopped else "length")
        assert tokenizer.eos_token_id not in sample.token_ids[:-1].tolist()

    batch = collate(prompt_ids, groups)
    recomputed = trainer(model_dir).logprobs(batch.input_ids, batch.attention_mask)
    torch.testing.assert_close(
        recomputed * batch.loss_mask, batch.behaviour_logprobs, atol=1e-4, rtol=0
    )


def test_stop_tokens_greedy_and_top_p(model_dir: Path, tokenizer) -> None:  # noqa: ANN001
    engine = HFRolloutEngine(model_dir, seed=1)
    prompt_ids = prompts(tokenizer, 3)
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    first, second = engine.generate(prompt_ids, 2, greedy), engine.generate(prompt_ids, 2, greedy)
    assert [s.token_ids.tolist() for g in first for s in g] == [
        s.token_ids.tolist() for g in second for s in g
    ]

    every_digit = tuple(tasks.VOCAB.index(d) for d in tasks.DIGITS)
    letters = tuple(
        i for i, tok in enumerate(tasks.VOCAB) if i not in every_digit and tok != "<eos>"
    )
    stop_on_anything = SamplingParams(max_tokens=5, stop_token_ids=every_digit + letters)
    for sample in (s for g in engine.generate(prompt_ids, 3, stop_on_anything) for s in g):
        assert len(sample.token_ids) == 1 and sample.finish_reason == "stop"

    # Mass before each sorted token: 0, .5, .8 -> with top_p .6 the .2 token goes.
    probs = torch.tensor([[0.3, 0.2, 0.5]])
    torch.testing.assert_close(_top_p_filter(probs, 0.6), torch.tensor([[0.3, 0.0, 0.5]]))


def test_load_state_dict_swaps_weights_and_rejects_unknown_names(
    model_dir: Path, tokenizer
) -> None:  # noqa: ANN001
    engine, train = HFRolloutEngine(model_dir), trainer(model_dir)
    prompt_ids = prompts(tokenizer, 2)
    greedy = SamplingParams(temperature=0.0, max_tokens=tasks.MAX_RESPONSE_TOKENS)
    before = engine.generate(prompt_ids, 1, greedy)
    with torch.no_grad():
        for param in train.model.parameters():
            param.add_(torch.randn_like(param))  # far from the init: the outputs must change
    engine.load_state_dict(train.export_weights(), version=7)
    assert engine.version == 7
    after = engine.generate(prompt_ids, 1, greedy)
    assert [s.logprobs.tolist() for g in before for s in g] != [
        s.logprobs.tolist() for g in after for s in g
    ]
    # The rollout now samples from exactly the trainer's weights.
    groups = engine.generate(prompt_ids, 2, SamplingParams(temperature=TEMPERATURE, max_tokens=4))
    batch = collate(prompt_ids, groups)
    recomputed = train.logprobs(batch.input_ids, batch.attention_mask)
    torch.testing.assert_close(
        recomputed * batch.loss_mask, batch.behaviour_logprobs, atol=1e-4, rtol=0
    )
    with pytest.raises(KeyError):
        engine.load_state_dict({"nope": torch.zeros(1)})


# ---- training ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batch(model_dir: Path, tokenizer) -> MicroBatch:  # noqa: ANN001
    prompt_ids = prompts(tokenizer, 3)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=tasks.MAX_RESPONSE_TOKENS)
    return collate(prompt_ids, HFRolloutEngine(model_dir, seed=2).generate(prompt_ids, 2, params))


def split(batch: MicroBatch, at: int) -> list[MicroBatch]:
    fields = ("input_ids", "attention_mask", "loss_mask", "advantages", "behaviour_logprobs")
    return [
        MicroBatch(**{f: getattr(batch, f)[part] for f in fields})
        for part in (slice(0, at), slice(at, None))
    ]


@pytest.mark.parametrize(
    "loss",
    [
        {},
        {"aggregation": "seq-mean-token-sum", "tis_cap": 2.0},
        {
            "policy_loss": "gspo",
            "eps_low": 3e-4,
            "eps_high": 4e-4,
            "aggregation": "seq-mean-token-mean",
        },
    ],
)
def test_train_step_is_on_policy_and_micro_batching_does_not_change_it(
    model_dir: Path, batch: MicroBatch, loss: dict[str, object]
) -> None:
    whole, parts = trainer(model_dir, **loss), trainer(model_dir, **loss)
    assert isinstance(whole, TrainEngine)
    metrics = whole.train_step([batch])
    parts.train_step(split(batch, 2))
    assert whole.step == parts.step == 1 and metrics["step"] == 1.0
    assert metrics["tokens"] == batch.loss_mask.sum().item()
    # The batch was sampled by these very weights: ratio 1, nothing clipped.
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["clip_frac"] == 0.0 and metrics["grad_norm"] > 0 and metrics["entropy"] > 0
    # Same gradient (compared before Adam, whose first step is ~lr * sign(g) and would
    # blow float-order noise on near-zero entries up to lr).
    for (name, a), b in zip(whole.model.named_parameters(), parts.model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "loss",
    [
        {},
        {
            "policy_loss": "gspo",
            "eps_low": 3e-4,
            "eps_high": 4e-4,
            "aggregation": "seq-mean-token-mean",
        },
        {"tis_cap": 2.0},
    ],
    ids=["ppo", "gspo", "tis"],
)
def test_a_behaviour_logprob_far_below_the_policy_is_clamped_and_the_step_trains(
    model_dir: Path, batch: MicroBatch, loss: dict[str, object]
) -> None:
    """One response token whose behaviour log-prob is -1e4 (pi / pi_behaviour = e^(~1e4)) in a
    row of advantage -1: unclamped, its ratio is inf, the loss inf and the gradient NaN, so the
    whole step would be skipped. Clamped at e^20, the step is finite, trains, and counts it."""
    train = trainer(model_dir, **loss)
    before = {name: p.detach().clone() for name, p in train.model.named_parameters()}
    far = MicroBatch(
        **{
            f: getattr(batch, f).clone()
            for f in (
                "input_ids",
                "attention_mask",
                "loss_mask",
                "advantages",
                "behaviour_logprobs",
            )
        }
    )
    row = int(torch.nonzero(far.advantages < 0)[0])
    token = int(torch.nonzero(far.loss_mask[row])[0])
    far.behaviour_logprobs[row, token] = -1e4
    metrics = train.train_step([far])
    assert np.isfinite(metrics["loss"]), (
        f"loss {metrics['loss']} with one behaviour log-prob of -1e4"
    )
    assert np.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0, (
        f"grad_norm {metrics['grad_norm']}: the step's gradient is not finite, "
        "so the step was skipped"
    )
    changed = [n for n, p in train.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before), f"only {len(changed)} of {len(before)} weights changed"
    assert metrics.get("log_ratio_clamped") == 1.0, (
        f"log_ratio_clamped {metrics.get('log_ratio_clamped')}: "
        "the one clamped token is not counted"
    )


def test_export_weights_are_cpu_copies_named_like_parameters(model_dir: Path) -> None:
    train = trainer(model_dir)
    weights = train.export_weights()
    assert list(weights) == [name for name, _ in train.model.named_parameters()]
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in weights.values())
    weights["model.norm.weight"].add_(1.0)
    assert not torch.equal(weights["model.norm.weight"], train.model.model.norm.weight)  # type: ignore[union-attr, arg-type]  # a Qwen2 model


def test_checkpoint_round_trip(model_dir: Path, batch: MicroBatch, tmp_path: Path) -> None:
    saved = trainer(model_dir)
    saved.train_step([batch])
    path = tmp_path / "ckpt" / "trainer.pt"
    path.parent.mkdir()
    (path.parent / ".trainer.pt.tmp").write_bytes(b"half a checkpoint a killed trainer left")
    saved.save_checkpoint(path, extra={"last_batch_seq": 42})
    assert sorted(p.name for p in path.parent.iterdir()) == ["trainer.pt"]  # no temp file left
    draws = (torch.rand(3), np.random.rand(3), random.random())

    restored = trainer(model_dir)
    assert restored.load_checkpoint(path) == {"last_batch_seq": 42}
    # RNG states come back: the same draws follow.
    assert torch.equal(torch.rand(3), draws[0])
    assert np.array_equal(np.random.rand(3), draws[1]) and random.random() == draws[2]
    assert restored.step == 1
    for a, b in zip(saved.model.parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(a, b)
    saved_opt, restored_opt = saved.optimizer.state_dict(), restored.optimizer.state_dict()
    for key, state in saved_opt["state"].items():
        for name, value in state.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(restored_opt["state"][key][name])
            )
    # Same model + same optimizer state -> the next step is identical too.
    saved.train_step([batch])
    restored.train_step([batch])
    for a, b in zip(saved.model.parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bfloat16_computes_in_bf16_on_float32_weights(model_dir: Path, batch: MicroBatch) -> None:
    config = LossConfig(temperature=TEMPERATURE)
    full = TorchTrainEngine(model_dir, lr=1e-2, seed=0, loss=config)
    half = TorchTrainEngine(model_dir, lr=1e-2, seed=0, loss=config, dtype=torch.bfloat16)
    exact = full.logprobs(batch.input_ids, batch.attention_mask)
    rounded = half.logprobs(batch.input_ids, batch.attention_mask)
    assert rounded.dtype == torch.float32 and not torch.equal(rounded, exact), (
        "the forward ran in bf16"
    )
    torch.testing.assert_close(rounded, exact, atol=0.05, rtol=0)
    metrics = half.train_step([batch])
    assert metrics["loss"] == pytest.approx(full.train_step([batch])["loss"], abs=0.01)
    assert {p.dtype for p in half.model.parameters()} == {torch.float32}, (
        "master weights stay float32"
    )
    assert {t.dtype for t in half.export_weights().values()} == {torch.float32}


def test_a_bare_cuda_device_gets_the_ranks_index(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cuda.set_device and NCCL refuse "cuda" without an index: the first H200 run of the
    # fsdp engine stopped there. Under torchrun each rank takes its own GPU.
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert with_index(torch.device("cuda"), 8) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert with_index(torch.device("cuda"), 8) == torch.device("cuda", 3)
    assert with_index(torch.device("cuda"), 2) == torch.device("cuda", 1)
    assert with_index(torch.device("cuda", 5), 8) == torch.device("cuda", 5)
    assert with_index(torch.device("cpu"), 8) == torch.device("cpu")


def test_the_device_is_the_processes_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert resolve_device() == (
        torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    )
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert resolve_device() == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    monkeypatch.setenv(DEVICE_ENV, "tpu0")
    with pytest.raises(
        ValueError, match=r"JETRL_DEVICE='tpu0': not a device \(auto, cpu, cuda or cuda:N\)"
    ):
        resolve_device()
    with pytest.raises(ValueError, match="JETRL_DEVICE='meta': only cpu and cuda are supported"):
        resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(
            ValueError, match="JETRL_DEVICE='cuda:1': no CUDA device is visible to this process"
        ):
            resolve_device("cuda:1")


def test_the_rollout_worker_builds_its_engine_in_the_run_dtype_on_its_device(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`engines.build.build_rollout_engine`: `model.dtype` and the worker's device reach the HF
    engine (it ran every rollout in float32 on the CPU, whatever the config or the GPU said)."""
    from engines.build import build_rollout_engine
    from schemas.config import RunConfig

    config = RunConfig.model_validate(
        {"run": "r", "model": {"path": str(model_dir), "dtype": "bfloat16"}}
    )
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    engine = build_rollout_engine(
        config.rollout.engine, model_dir, seed=0, dtype=config.model.dtype
    )
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in engine.model.parameters()} == {"cpu"}
    [[sample]] = engine.generate([[3, 4, 5]], 1, SamplingParams(max_tokens=4))
    assert sample.logprobs.dtype == torch.float32 and torch.isfinite(sample.logprobs).all()
    if not torch.cuda.is_available():
        monkeypatch.setenv(DEVICE_ENV, "cuda")
        with pytest.raises(ValueError, match="no CUDA device is visible"):
            build_rollout_engine(config.rollout.engine, model_dir, seed=0, dtype=config.model.dtype)
