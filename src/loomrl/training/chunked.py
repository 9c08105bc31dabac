"""Log-probs and entropy of the next tokens without a ``[tokens, vocabulary]`` tensor.

The plain way, ``log_softmax(lm_head(hidden))``, holds the logits, their log-softmax, its
exponent and their product for every token of a micro-batch, in fp32, and keeps most of
them for backward: with Qwen2's 151,936-token vocabulary that is 0.6 GB per 1,000 tokens
each, more than the whole rest of a 0.5B model's activations. Here the output projection
runs a chunk of tokens at a time, in fp32 (outside any autocast), and only the two numbers
per token that the loss needs leave the chunk; backward recomputes each chunk's logits and
writes the gradients of the hidden states and of the projection weight directly, so at
most one chunk's ``[chunk, vocabulary]`` block (and a few of its temporaries) is alive.

The result equals the full computation up to float rounding (the tests check 1e-6 on
log-probs and entropy, 1e-5 relative on gradients); ``bench/trainer_memory.py`` measures
what it saves.
"""

from __future__ import annotations

import torch


class ChunkedLogprobs(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], targets [N]) -> (logp [N], entropy [N])`` of
    ``softmax(hidden @ weight.T / temperature)``, a chunk of ``chunk`` rows at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int):
        w = weight.float()
        logp = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        for start in range(0, hidden.shape[0], chunk):
            end = start + chunk
            logp_all = _chunk_logsoftmax(hidden[start:end], w, temperature)  # [chunk, vocab]
            logp[start:end] = logp_all.gather(-1, targets[start:end, None]).squeeze(-1)
            entropy[start:end] = -(logp_all.exp().mul_(logp_all)).sum(-1)
            del logp_all
        ctx.save_for_backward(hidden, weight, targets, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, entropy = ctx.saved_tensors
        w = weight.float()
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        grad_logp = grad_logp.float() if grad_logp is not None else torch.zeros_like(entropy)
        grad_entropy = (
            grad_entropy.float() if grad_entropy is not None else torch.zeros_like(entropy)
        )
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = start + ctx.chunk
            h = hidden[start:end].float()
            # log p, recomputed; becomes d loss / d z in place
            grad_z = _chunk_logsoftmax(h, w, ctx.temperature)
            probs = grad_z.exp()
            # d logp_t / dz = onehot(t) - p;  d entropy / dz = -p * (log p + entropy)
            g_lp, g_ent = grad_logp[start:end, None], grad_entropy[start:end, None]
            grad_z.add_(entropy[start:end, None]).mul_(-g_ent).sub_(g_lp).mul_(probs)
            del probs
            grad_z.scatter_add_(-1, targets[start:end, None], g_lp)
            if ctx.temperature != 1.0:
                grad_z.div_(ctx.temperature)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_z @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad_z.t(), h)
            del grad_z
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _chunk_logsoftmax(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T / temperature)`` in fp32 ``[chunk, vocab]``, with one
    other block of that size alive at most (the logits, freed on return)."""
    logits = hidden.float() @ weight.t()
    if temperature != 1.0:
        logits.div_(temperature)
    return torch.log_softmax(logits, dim=-1)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [..., H]`` and ``targets [...]`` -> fp32 ``(logp, entropy)`` shaped like
    ``targets``, computed outside autocast (see ``ChunkedLogprobs``)."""
    shape = targets.shape
    with torch.autocast(hidden.device.type, enabled=False):
        logp, entropy = ChunkedLogprobs.apply(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            targets.reshape(-1),
            float(temperature),
            int(chunk),
        )
    return logp.view(shape), entropy.view(shape)


def output_weight(model: torch.nn.Module) -> torch.Tensor | None:
    """The output projection's weight when it is a plain bias-free ``Linear`` (what the
    chunked path computes); None otherwise (e.g. a LoRA-adapted head), for the full path."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is torch.nn.Linear and head.bias is None:
        return head.weight
    return None


def final_hidden(model: torch.nn.Module, **inputs):
    """The decoder's output (``last_hidden_state``, after the final norm, and its cache):
    the causal LM's forward without its output projection."""
    return model.get_decoder()(**inputs)
