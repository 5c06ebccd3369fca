"""Log-probabilities and entropy of response tokens under a causal LM.

The sequence a role sees is `input_ids = cat(prompt_ids, responses)` with
`attention_mask = cat(prompt_mask, response_attention)` (= `response_mask` unless multi-turn rows
hold observation tokens, see `raygraph.batch`; prompts left-padded, responses right-padded,
so the first response token sits at column P). Position ids count real tokens only,
`position_ids = cumsum(attention_mask) - 1` clamped at 0, so a row's positions, and hence its
log-probs, do not depend on how much padding the batch carries. The logit at column `P - 1 + t`
predicts response token `t`; logits are divided by the sampling temperature first, so the
log-probs are those of the distribution the sampler drew from.

Two forward layouts give the same numbers:

* padded (default): one `(B, P + R)` forward; only the R needed positions go through `lm_head`
  (`logits_to_keep`).
* packed / padding-free: the valid tokens of all rows are concatenated into one `(1, N)` row
  whose position ids restart at 0 for each sequence. Hugging Face turns that into per-sequence
  attention: with flash-attention 2 through the varlen kernel (no pad token is ever computed,
  the reason to pack); with SDPA/eager through a block-diagonal `(N, N)` mask, which is correct
  but no cheaper than padding, so `packed=None` ("auto") packs only with flash-attention.

Shared prompts (padded layout): GRPO-style batches hold n samples per prompt in consecutive
rows. When prompts repeat, each distinct prompt is run ONCE (its keys/values cached, with
gradients when training), the cache is repeated for its samples, and only the responses are
run on top (`shared_prompts`, on by default). Same numbers up to float rounding (tested to 1e-5,
gradients included); the prompt tokens' share of the forward (and backward) pass shrinks n-fold.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn

from raygraph.algos.entropy import entropy_from_logits
from raygraph.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_MASK,
    RESPONSES,
    SEQUENCE_COLUMNS,
    Batch,
    pad_right,
    response_attention,
)

__all__ = [
    "forward_response", "position_ids_from_mask", "prefill", "prompt_runs", "response_logprobs",
    "sequence_inputs", "token_logprobs", "token_logprobs_of_sequence", "use_packed",
]

Tensor = torch.Tensor
Tensors = Batch | Mapping[str, Tensor]


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """`(B, T)` 0/1 mask -> `(B, T)` int64 positions `cumsum(mask) - 1`, clamped at 0 on left pads."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sequence_inputs(prompt_ids: Tensor, prompt_mask: Tensor, responses: Tensor,
                    response_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`(input_ids, attention_mask, position_ids)`, each `(B, P + R)`, for prompt + response."""
    input_ids = torch.cat([prompt_ids, responses], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    return input_ids, attention_mask, position_ids_from_mask(attention_mask)


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """`log_softmax(logits)[..., label]` in float32. logits `(..., V)`, labels `(...)` -> `(...)`."""
    logits = logits.float()
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def use_packed(model: nn.Module, packed: bool | None) -> bool:
    """Resolve `packed=None` (auto): pack only when the model runs flash-attention."""
    if packed is not None:
        return packed
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    return impl.startswith("flash_attention")


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model   # peft passes it on
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def _logits_at(model: nn.Module, positions: Tensor, **inputs: Tensor) -> Tensor:
    """Logits `(B, K, V)` at sequence `positions` (1-D, K entries); lm_head runs only there."""
    if _accepts_logits_to_keep(model):
        return model(**inputs, use_cache=False, logits_to_keep=positions).logits
    return model(**inputs, use_cache=False).logits[:, positions]


def forward_response(
    model: nn.Module,
    tensors: Tensors,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    packed: bool = False,
    shared_prompts: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """One forward over `tensors` (no micro-batching; gradients flow if autograd is on).

    Args:
        model: a causal LM returning `.logits`.
        tensors: `prompt_ids`, `prompt_mask` `(B, P)`, `responses`, `response_mask` `(B, R)`, and
            `response_attention` when the responses hold tokens that are attended but not scored.
        temperature: logits are divided by it before the softmax.
        with_entropy: also return the entropy of each predicted distribution.
        entropy_grad: let gradients flow through the entropy (for an entropy bonus).
        packed: use the padding-free layout (see the module docstring).
        shared_prompts: run each distinct prompt of consecutive identical ones once (padded
            layout only; see the module docstring).

    Returns:
        `(logprobs, entropy)`: `(B, R)` float32, 0 where `response_mask` is 0; entropy None
        unless `with_entropy`.
    """
    device = _device_of(model)
    prompt_ids, prompt_mask = tensors[PROMPT_IDS].to(device), tensors[PROMPT_MASK].to(device)
    responses, response_mask = tensors[RESPONSES].to(device), tensors[RESPONSE_MASK].to(device)
    attended = response_attention(tensors).to(device)   # = response_mask unless multi-turn
    input_ids, attention_mask, position_ids = sequence_inputs(prompt_ids, prompt_mask, responses, attended)
    P, R = prompt_ids.shape[1], responses.shape[1]
    target = response_mask.bool()  # (B, R)
    if packed:
        valid = attention_mask.bool()  # (B, T)
        packed_index = valid.flatten().cumsum(0).view(valid.shape) - 1  # (B, T) index in the packed row
        predecessor = packed_index[:, P:][target] - 1  # (K,) the token before each response token
        logits = _logits_at(model, predecessor, input_ids=input_ids[valid][None],
                            position_ids=position_ids[valid][None])[0]  # (K, V)
        labels = responses[target]  # (K,)
    else:
        groups = None
        if shared_prompts and _can_share(model):
            groups = prompt_runs(prompt_ids, prompt_mask, always=_data_parallel())
        if groups is not None:
            logits = _shared_prompt_logits(model, prompt_ids, responses, attention_mask, position_ids, *groups)
        else:
            logits = _logits_at(model, torch.arange(P - 1, P - 1 + R, device=device), input_ids=input_ids,
                                attention_mask=attention_mask, position_ids=position_ids)  # (B, R, V)
        labels = responses
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = token_logprobs(logits, labels)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    if packed:
        return _unpack(logprobs, target), None if entropy is None else _unpack(entropy, target)
    mask = target.to(logprobs.dtype)
    return logprobs * mask, None if entropy is None else entropy * mask


def _can_share(model: nn.Module) -> bool:
    # Gradient checkpointing turns the KV cache off in training; the cache must then be rebuilt.
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    params = inspect.signature(model.forward).parameters
    return not checkpointing and "logits_to_keep" in params and "cache" in params


def _data_parallel() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def prompt_runs(prompt_ids: Tensor, prompt_mask: Tensor, *, always: bool = False) -> tuple[Tensor, Tensor] | None:
    """`(first row, size)` of each run of identical consecutive prompts.

    None when sharing would save little (fewer than 2 rows per distinct prompt on average),
    unless `always`: data-parallel ranks must make the same model calls whatever their data
    (FSDP gathers parameters in every call), so under torch.distributed every rank takes the
    shared path, which is exact for runs of one row too.
    """
    rows = prompt_ids.shape[0]
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(-1) & (prompt_mask[1:] == prompt_mask[:-1]).all(-1)
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=same.device), ~same]).nonzero().squeeze(-1)
    if starts.numel() * 2 > rows and not always:
        return None
    sizes = torch.diff(torch.cat([starts, torch.tensor([rows], device=starts.device)]))
    return starts, sizes


def prefill(model: nn.Module, prompt_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
            runs: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, object]:
    """Run the prompts with a KV cache: `(logits at the last prompt column (B, V), cache)`.

    With `runs` (`prompt_runs`), each distinct prompt runs once and its logits and cache are
    repeated for its rows (differentiable: gradients of every row reach the shared prompt).
    """
    if runs is None:
        out = model(input_ids=prompt_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], out.cache
    starts, sizes = runs
    out = model(input_ids=prompt_ids[starts], attention_mask=attention_mask[starts],
                position_ids=position_ids[starts], use_cache=True, logits_to_keep=1)
    rows = torch.arange(len(starts), device=starts.device).repeat_interleave(sizes)
    out.cache.reorder_cache(rows)   # every layer type; index_select keeps the gradients
    return out.logits[:, -1][rows], out.cache


def _shared_prompt_logits(model: nn.Module, prompt_ids: Tensor, responses: Tensor, attention_mask: Tensor,
                          position_ids: Tensor, starts: Tensor, sizes: Tensor) -> Tensor:
    """Logits `(B, R, V)` predicting each response token, each distinct prompt run once."""
    P, R = prompt_ids.shape[1], responses.shape[1]
    first, cache = prefill(model, prompt_ids, attention_mask[:, :P], position_ids[:, :P], (starts, sizes))
    if R == 1:
        return first[:, None]
    rest = model(input_ids=responses[:, :-1], attention_mask=attention_mask[:, :P + R - 1],
                 position_ids=position_ids[:, P:P + R - 1], cache=cache, use_cache=True,
                 logits_to_keep=0).logits   # (B, R - 1, V): predicts response tokens 1..R-1
    return torch.cat([first[:, None], rest], dim=1)


def _unpack(values: Tensor, target: Tensor) -> Tensor:
    """`(K,)` values of the True entries of `target` `(B, R)` -> `(B, R)`, zeros elsewhere."""
    out = torch.zeros(target.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(target, values)


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def response_logprobs(
    model: nn.Module,
    batch_or_tensors: Tensors,
    *,
    temperature: float = 1.0,
    micro_batch_size: int = 16,
    max_tokens_per_micro_batch: int | None = None,
    with_entropy: bool = False,
    packed: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropy) of every response token, micro-batched, without gradients.

    Args:
        model: a causal LM (eval mode is the caller's choice).
        batch_or_tensors: a `Batch` or mapping with `prompt_ids`, `prompt_mask`, `responses`,
            `response_mask`.
        temperature: the sampling temperature the responses were drawn with.
        micro_batch_size: rows per forward pass.
        max_tokens_per_micro_batch: also cap a pass at this many padded tokens, padding trimmed
            (`Batch.micro_batches`).
        with_entropy: also return per-position entropy.
        packed: padding-free layout; None = auto (flash-attention only), see module docstring.

    Returns:
        `(logprobs (B, R), entropy (B, R) | None)`, float32 on CPU, 0 on padded positions.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    names = [name for name in SEQUENCE_COLUMNS if name in batch_or_tensors]
    columns = Batch({name: batch_or_tensors[name] for name in names})
    width = columns[RESPONSES].shape[1]
    packed = use_packed(model, packed)
    logprobs, entropies = [], []
    for micro in columns.micro_batches(micro_batch_size, max_tokens_per_micro_batch):
        lp, ent = forward_response(model, micro.tensors, temperature=temperature, with_entropy=with_entropy,
                                   packed=packed)
        logprobs.append(pad_right(lp.cpu(), width))
        if ent is not None:
            entropies.append(pad_right(ent.cpu(), width))
    return torch.cat(logprobs), torch.cat(entropies) if with_entropy else None


def token_logprobs_of_sequence(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                               temperature: float = 1.0) -> Tensor:
    """Log-prob of each token given the ones before it, for whole sequences (SFT, DPO).

    Args:
        input_ids, attention_mask: `(B, T)`, padding on either side.

    Returns:
        `(B, T - 1)` float32: entry t is log p(input_ids[:, t + 1] | input_ids[:, :t + 1]).
    """
    position_ids = position_ids_from_mask(attention_mask)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    return token_logprobs(logits, input_ids[:, 1:])
