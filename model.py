"""A nanoGPT-style GPT for packed documents: pre-LayerNorm blocks, GELU MLP, tied embeddings,
learned-absolute or rotary positions taken from explicit position ids.

All attention masking is `attention_mask`, built once per batch from the document ids and shared by every layer:
  - doc_mask on, CUDA:  a FlexAttention BlockMask (block-sparse: tiles between documents are skipped)
  - doc_mask on, CPU:   a dense boolean mask for SDPA (FlexAttention has no backward on CPU)
  - doc_mask off:       None, plain causal attention (SDPA is_causal) across documents
It is built outside the model so that a compiled model is one graph (as torchtitan does). Given targets, the
forward returns the loss from the same compiled graph, so the logits are never copied to float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 8192
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False  # biases in the attention and MLP projections, as GPT-2 has (LayerNorms always have them)
    gelu: str = "exact"  # "exact" | "tanh", GPT-2's own approximation (`gelu_new`)
    pos_emb: str = "learned"  # "learned" | "rope"
    rope_base: float = 10000.0
    attn_impl: str = "auto"  # "auto" (flex on CUDA, sdpa elsewhere) | "flex" | "sdpa"


# ----------------------------------------------------------------------------------------------
# Attention masks. Named mask functions in the style of attention-gym.


def document_causal_dense(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean: query i may attend to key j iff j <= i and both are in the same document."""
    T = doc_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same_doc & causal)[:, None]


def document_causal_by_ids(doc_ids: torch.Tensor):
    """The mask function as the definition reads: causal, and the same document id (two gathers a score)."""

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return document_causal


def document_causal_block_mask(doc_ids: torch.Tensor) -> BlockMask:
    """The dense mask as a BlockMask."""
    return block_mask_over_rows(document_causal_by_ids(doc_ids), doc_ids)


def block_mask_over_rows(mask_function, doc_ids: torch.Tensor) -> BlockMask:
    """A mask function's BlockMask over these rows. B must be the batch size: with B=None a batch-dependent mask
    is silently wrong in the compiled kernel."""
    B, T = doc_ids.shape
    build = compiled_create_block_mask if doc_ids.is_cuda else create_block_mask
    return build(mask_function, B=B, H=None, Q_LEN=T, KV_LEN=T, device=doc_ids.device)


# Lazy: nothing compiles until the first call; inside a compiled model the call is inlined into its graph.
compiled_create_block_mask = torch.compile(create_block_mask)
compiled_flex_attention = torch.compile(flex_attention, dynamic=False)


AttentionMask = BlockMask | torch.Tensor | None


def attention_impl(doc_mask: bool, attn_impl: str, device: torch.device) -> str:
    """'flex' or 'sdpa', decided here only: the document mask runs on FlexAttention on CUDA (auto) or when
    asked for; SDPA computes everything else."""
    if doc_mask and (attn_impl == "flex" or (attn_impl == "auto" and device.type == "cuda")):
        return "flex"
    return "sdpa"


def attention_mask(doc_ids: torch.Tensor, doc_mask: bool, attn_impl: str = "auto") -> AttentionMask:
    """The doc_mask flag: its whole effect is this function. Once per batch, outside the compiled model."""
    if not doc_mask:
        return None
    if attention_impl(doc_mask, attn_impl, doc_ids.device) == "flex":
        return document_causal_block_mask(doc_ids)
    return document_causal_dense(doc_ids)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if isinstance(mask, BlockMask):
        # compiled even in an eager model: eager flex is only a slow reference (inlined in a compiled model)
        return compiled_flex_attention(q, k, v, block_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# ----------------------------------------------------------------------------------------------
# Positions


def rope_tables(head_dim: int, max_positions: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x1[i], x2[i]) of the two halves of each head, in float32; qk is q and k together,
    (B, T, 2, H, D), and cos/sin are (B, T, 1, 1, D/2)."""
    x1, x2 = qk.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(qk)


# ----------------------------------------------------------------------------------------------
# The network


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: AttentionMask, rope: tuple | None) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head)
        q, k, v = qkv.unbind(2)
        if rope is not None:
            # rotated in the (B, T, H, D) layout, q and k in one call: the attention output takes the
            # query's memory layout, so the transpose back to (B, T, C) below stays a view, not a copy
            q, k = apply_rope(qkv[:, :, :2], *rope).unbind(2)
        y = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.approximate = "tanh" if config.gelu == "tanh" else "none"
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(config.n_embd), nn.LayerNorm(config.n_embd)
        self.attn, self.mlp = CausalSelfAttention(config), MLP(config)

    def forward(self, x: torch.Tensor, mask: AttentionMask, rope: tuple | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask, rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.pos_emb not in ("learned", "rope"):
            raise ValueError(f"pos_emb must be 'learned' or 'rope', got {config.pos_emb!r}")
        if config.gelu not in ("exact", "tanh"):
            raise ValueError(f"gelu must be 'exact' or 'tanh', got {config.gelu!r}")
        if config.n_embd % config.n_head or (config.n_embd // config.n_head) % 2:
            raise ValueError(f"n_embd {config.n_embd} must split into n_head {config.n_head} heads of even size")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.seq_len, config.n_embd) if config.pos_emb == "learned" else None
        if config.pos_emb == "rope":
            cos, sin = rope_tables(config.n_embd // config.n_head, config.seq_len, config.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, position_ids: torch.Tensor, mask: AttentionMask, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Ids and position ids (B, T), `mask` from `attention_mask`. Returns the logits, or given targets each
        token's cross-entropy in float32 (B, T), 0 where the target is data.IGNORE_INDEX (torch's default)."""
        if idx.shape[1] > self.config.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than seq_len {self.config.seq_len}")
        x = self.wte(idx)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(position_ids)
        else:
            rope = (self.rope_cos[position_ids][:, :, None, None], self.rope_sin[position_ids][:, :, None, None])
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, mask, rope)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        return losses.view_as(targets)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        stop_token: int | None = None,
    ) -> torch.Tensor:
        """Continue one document from (1, T0) ids; the context is the last seq_len tokens at positions 0.., as
        for a row that starts mid-document. One document needs only causal attention (SDPA, any length)."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.seq_len :]
            positions = torch.arange(context.shape[1], device=idx.device).expand_as(context)
            logits = self(context, positions, None)[:, -1].double()
            if temperature == 0:
                next_id = logits.argmax(-1, keepdim=True)
            else:
                # largest shifted to 0, in float64: a tiny temperature gives -inf, never inf - inf = nan
                logits = (logits - logits.max(-1, keepdim=True).values) / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, -float("inf"))
                next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, next_id], dim=1)
            if stop_token is not None and next_id.item() == stop_token:
                break
        return idx
