"""Reference rollout engine: a Hugging Face causal LM and an explicit batched decode loop.

Why not ``model.generate``: it costs ~2.5 ms of Python per decode step on CPU and hands
back processed scores, not the behaviour log-probs we need. Here one forward per step
serves every sample of every prompt (all prompts x n samples in one batch), with a KV
cache, and the log-prob of each sampled token is taken from the very logits it was
sampled from.

Behaviour log-probs: ``log_softmax(logits / temperature)[token]`` -- temperature applied,
top-p truncation *not* renormalised into it. This is what verl and AReaL record, and it is
what the trainer recomputes (`TorchTrainEngine` with the same temperature), so a sample
trained by the weights that drew it has importance ratio 1 up to float error. With
``temperature == 0`` (greedy, for evaluation) the log-probs are under temperature 1.

Memory (`ReleasableEngine`, `placement: colocated`): `release_memory` moves every parameter
and buffer storage off the device and frees it (`engines.release.Offload`: to host memory
from a GPU; to a temporary file on the CPU, so that the process's resident memory drops);
the KV cache lives only inside `generate`, so there is none to drop. Weights loaded while
released wait on the host and load, read back, in `resume_memory` (`engines.release`).
"""

from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DynamicCache

from engines.algorithms.logprobs import scaled_logits
from engines.algorithms.losses import gather_logprobs
from engines.protocols import Sample, SamplingParams, WeightsNotLoaded
from engines.release import Deferred, Offload
from engines.weights_group import Spec, bare_group, sha256_of


class HFRolloutEngine:
    """Generates with a local HF model; `load_state_dict` swaps weights between calls.

    Not thread-safe: a caller that runs `generate` in a worker thread must not call
    `load_state_dict` until it returns (the weights would change mid-sequence).
    """

    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        self.device = torch.device(device)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        # transformers types `to` through a decorator that mypy reads as unbound.
        self.model = model.to(self.device)  # type: ignore[arg-type]
        self.model.eval()
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            raise ValueError(f"{model_dir} declares no eos_token_id")
        self.eos_token_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, list) else (eos,)
        pad = self.model.generation_config.pad_token_id
        self.pad_token_id: int = self.eos_token_ids[0] if pad is None else pad
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.version = 0
        self.groups: dict[str, dist.ProcessGroupGloo | dist.ProcessGroupNCCL] = {}
        """Weight-update groups joined, by name (`join_weights_group`)."""
        self.group_timeout_s = 60.0
        """How long a weight-update group's rendezvous and each broadcast may wait."""
        self.offload = Offload.of_module(self.model)
        """Its weights off the device between phases (`release_memory`)."""
        self.deferred = Deferred()
        """Weights loaded while released, loaded on `resume_memory`."""

    def device_bytes(self) -> int:
        """Bytes of the model's parameters and buffers on the device now (0 once released)."""
        return self.offload.held_bytes()

    def release_memory(self) -> None:
        """Weights and buffers off the device and freed (see the module doc); no generation
        until `resume_memory`. Releasing a released engine does nothing."""
        with self.deferred.lock:
            self.offload.release()

    def resume_memory(self) -> None:
        """Weights back on the device, then the ones loaded meanwhile loaded and read back
        (`WeightsNotLoaded` when they do not: the engine may hold a mix of versions)."""
        with self.deferred.lock:
            self.offload.resume()
            deferred = self.deferred.take()
            if deferred is not None:
                self.load_state_dict(*deferred)

    def check_held(self, what: str) -> None:
        """Refuse `what` on an engine whose weights are off the device."""
        if self.offload.released:
            raise RuntimeError(f"hf: {what} while the engine's memory is released")

    @torch.inference_mode()
    def load_state_dict(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Copies `tensors` (named as `TorchTrainEngine.export_weights`) into the model in place,
        then reads each parameter back.

        `tensors` may be any subset of the model's parameter names (tied weights appear once):
        the parameters not named keep what they hold. An unknown name raises KeyError before
        anything is copied; a parameter that does not read back as its tensor (cast to the
        model's dtype) raises `WeightsNotLoaded` naming it, and `version` is not set. `version`
        defaults to the current one plus 1. While the memory is released the tensors are kept
        and loaded on `resume_memory` (`version` is set now: nothing generates before then).
        """
        with self.deferred.lock:  # not while the memory is being released or resumed
            self.load_held_or_defer(tensors, version)

    def load_held_or_defer(self, tensors: dict[str, torch.Tensor], version: int | None) -> None:
        params = dict(self.model.named_parameters())
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise KeyError(f"weight names the model does not have: {unknown[:5]}")
        if self.offload.released:
            self.version = self.version + 1 if version is None else version
            self.deferred.add(tensors, self.version)
            return
        self._copy({name: params[name] for name in tensors}, tensors)
        for name, tensor in tensors.items():
            param = params[name]
            if not torch.equal(param, tensor.to(device=param.device, dtype=param.dtype)):
                raise WeightsNotLoaded(f"hf: {name} does not read back as the tensor loaded")
        self.version = self.version + 1 if version is None else version

    weight_ranks = 1
    """One rank in a weight-update group (`engines.weights_group.GroupWeights`)."""

    def join_weights_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Joins `group_name` at the rendezvous SGLang's `init_weights_update_group` uses (a
        TCPStore client at master_address:master_port, prefixed by the name), as the bare
        backend objects of `weights_group.bare_group`: nothing registered under the name, so
        several copies in one process each hold a rank. Its waits end after
        `group_timeout_s`."""
        timeout = timedelta(seconds=self.group_timeout_s)
        store = dist.TCPStore(master_address, master_port, None, False, timeout)
        prefixed = dist.PrefixStore(group_name, store)
        backends = bare_group(prefixed, rank_offset, world_size, group_name, backend, timeout)
        self.groups[group_name] = backends[self.device.type]

    def receive_weights(
        self, specs: Sequence[Spec], group_name: str, checksums: Mapping[str, str], version: int
    ) -> None:
        """One broadcast per spec from group rank 0, as SGLang's
        `update_weights_from_distributed` receives them: straight into the parameter when its
        dtype and shape are the spec's, else into a tensor of the spec's, copied (cast) in
        after. Then each tensor as it arrived must match its sha256 in `checksums`, and each
        parameter must read back as it (`WeightsNotLoaded` otherwise: the caller loads the
        stored copy whole). Refused while the memory is released (the tensors' storage is
        gone; colocation refuses the collective transport anyway)."""
        self.check_held("a broadcast weight load")
        group = self.groups[group_name]  # KeyError: no such group joined
        params = dict(self.model.named_parameters())
        unknown = sorted({name for name, _, _ in specs} - set(params))
        if unknown:
            raise KeyError(f"weight names the model does not have: {unknown[:5]}")
        arrived: dict[str, torch.Tensor] = {}
        works = []
        for name, dtype, shape in specs:
            param = params[name]
            same_dtype = str(param.dtype).removeprefix("torch.") == dtype
            direct = same_dtype and list(param.shape) == list(shape)
            into = (
                param.data
                if direct
                else torch.empty(list(shape), dtype=getattr(torch, dtype), device=param.device)
            )
            arrived[name] = into
            # c10d backends have `broadcast` at runtime; torch's stubs leave it out.
            wait = timedelta(seconds=self.group_timeout_s)
            works.append(group.broadcast(into, 0, wait))  # type: ignore[union-attr]
        for work in works:
            work.wait()
        with torch.no_grad():
            for name, tensor in arrived.items():
                if tensor is not params[name].data:
                    params[name].copy_(tensor)
        for name, tensor in arrived.items():
            if sha256_of(tensor) != checksums.get(name):
                raise WeightsNotLoaded(f"hf: {name} arrived unlike its sha256 in the manifest")
            param = params[name]
            if not torch.equal(param, tensor.to(device=param.device, dtype=param.dtype)):
                raise WeightsNotLoaded(f"hf: {name} does not read back as the tensor received")
        self.version = version

    def leave_weights_group(self, group_name: str) -> None:
        self.groups.pop(group_name, None)  # dropped: its sockets close

    def _copy(
        self, params: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor]
    ) -> None:
        """Writes each tensor into its parameter (copy_ casts dtype and device; a shape
        mismatch raises)."""
        for name, param in params.items():
            param.copy_(tensors[name])

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        """`n` samples per prompt, grouped per prompt; see the module doc for the log-probs."""
        self.check_held("generate")
        rows = [list(p) for p in prompts for _ in range(n)]
        if not rows or min(map(len, rows)) == 0:
            raise ValueError("need at least one non-empty prompt")
        input_ids, attention_mask = self._left_pad(rows)
        # Positions count real tokens only, so left padding does not shift RoPE.
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]  # [B, V]

        batch = len(rows)
        stop_ids = torch.tensor((*self.eos_token_ids, *params.stop_token_ids), device=self.device)
        tokens = torch.full((batch, params.max_tokens), self.pad_token_id, device=self.device)
        logprobs = torch.zeros(batch, params.max_tokens, device=self.device)
        lengths = torch.full((batch,), params.max_tokens, device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        next_position = positions[:, -1:] + 1  # [B, 1]
        for step in range(params.max_tokens):
            token, logprob = self._sample(logits, params)
            token = token.masked_fill(done, self.pad_token_id)  # finished rows only idle
            tokens[:, step], logprobs[:, step] = token, logprob
            stopped = ~done & torch.isin(token, stop_ids)
            lengths[stopped] = step + 1  # the stop token is part of the response
            done |= stopped
            if bool(done.all()) or step + 1 == params.max_tokens:
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
            logits = self.model(
                input_ids=token.unsqueeze(1),
                attention_mask=attention_mask,
                position_ids=next_position,
                cache=cache,
                use_cache=True,
            ).logits[:, -1]
            next_position = next_position + 1

        samples = [
            Sample(
                token_ids=tokens[i, : lengths[i]].cpu(),
                logprobs=logprobs[i, : lengths[i]].float().cpu(),
                finish_reason="stop" if done[i] else "length",
            )
            for i in range(batch)
        ]
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-pads token rows: ids [B, P] int64 and attention mask [B, P] int64."""
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _sample(
        self, logits: torch.Tensor, params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draws one token per row. logits [B, V] -> (tokens [B] int64, logprobs [B] float32)."""
        if params.temperature == 0:
            token = logits.argmax(-1)
            return token, gather_logprobs(logits, token)
        logp = torch.log_softmax(scaled_logits(logits.float(), params.temperature), dim=-1)
        probs = logp.exp()
        if params.top_p < 1.0:
            probs = _top_p_filter(probs, params.top_p)
        token = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        return token, logp.gather(-1, token.unsqueeze(1)).squeeze(1)


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zeroes the tail outside the smallest set whose mass reaches `top_p`. [B, V] -> [B, V].

    Not renormalised: `torch.multinomial` accepts unnormalised weights.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep a token if the mass *before* it is still below top_p (the top token always stays).
    drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
