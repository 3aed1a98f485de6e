"""The decoder-only transformer, GPT-2 and its later variants: embeddings, pre-norm blocks, LM head (no I/O).

The modules hold the parameters under GPT-2's names; the computation is written once, as functions over
the `ModelWeights` tree that `GPT.weights()` reads from them. `GPT.forward` runs it for training, prefill,
single-token decoding through a KV cache and attention maps alike; a caller that steps many times
(a decoder) reads the tree once and passes it in, sparing every step the nn.Module attribute lookups.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from minigpt.model.config import GPTConfig
from minigpt.model.kvcache import KVCache, first_position, position_ids
from minigpt.model.lora import LoRAConfig, base_config, join_added_rows
from minigpt.model.memory import score_chunks
from minigpt.model.weights import (
    AttentionWeights,
    BlockWeights,
    LinearWeights,
    MLPWeights,
    ModelWeights,
    NormWeights,
    block_shapes,
    check_shapes,
    expected_shapes,
    is_adapter_tensor,
    weights_by_name,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "KVCache",
    "attend",
    "attention_logits",
    "block",
    "attention_mask",
    "head",
    "head_loss",
    "build_model",
    "linear",
    "mlp",
    "model_tensors",
    "norm",
    "qkv",
    "rotary",
    "rotate",
    "transformer",
]

Cache = KVCache[torch.Tensor]
Rotary = tuple[torch.Tensor, torch.Tensor]  # cos and sin of every position's angles, (T, head_dim)


@contextlib.contextmanager
def _skip_init() -> Iterator[None]:
    # random init of a large model costs seconds, and the meta device pulls in torch._dynamo for
    # nn.Embedding; loading only needs the storage, so the init methods become no-ops for a moment
    classes = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)
    saved = [c.reset_parameters for c in classes]
    saved_gpt = GPT.reset_parameters
    try:
        for c in classes:
            c.reset_parameters = lambda self: None  # type: ignore[method-assign]
        GPT.reset_parameters = lambda self: None  # type: ignore[method-assign]
        yield
    finally:
        for c, fn in zip(classes, saved, strict=True):
            c.reset_parameters = fn  # type: ignore[method-assign]
        GPT.reset_parameters = saved_gpt  # type: ignore[method-assign]


Shapes = dict[str, tuple[int, ...]]  # a block's tensors by name, as `weights.block_shapes` states them


def _norm(config: GPTConfig, shapes: Shapes, name: str) -> nn.Module:
    """The norm `name` with the width its weight has: an RMSNorm (QK-norm always), else a LayerNorm."""
    (width,) = shapes[f"{name}.weight"]
    if config.norm == "rmsnorm" or name.endswith(("q_norm", "k_norm")):
        return nn.RMSNorm(width, eps=config.layer_norm_eps)
    return nn.LayerNorm(width, eps=config.layer_norm_eps, bias=f"{name}.bias" in shapes)


def _linear(shapes: Shapes, name: str) -> nn.Linear:
    out_features, in_features = shapes[f"{name}.weight"]
    return nn.Linear(in_features, out_features, bias=f"{name}.bias" in shapes)


class ScoreMap(nn.Module):
    """One of the attention score's per-head maps (`weights.score_shapes`), held as `weight`."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


class CausalSelfAttention(nn.Module):
    """Parameters of multi-head causal self-attention (computed by `attend`)."""

    def __init__(self, config: GPTConfig, shapes: Shapes) -> None:
        super().__init__()
        self.c_attn = _linear(shapes, "attn.c_attn")
        self.c_proj = _linear(shapes, "attn.c_proj")
        if config.qk_norm:
            self.q_norm = _norm(config, shapes, "attn.q_norm")
            self.k_norm = _norm(config, shapes, "attn.k_norm")
        if "attn.v_embed.weight" in shapes:
            self.v_embed = nn.Embedding(*shapes["attn.v_embed.weight"])
        for name, shape in shapes.items():
            if name.startswith("attn.score"):
                setattr(self, name.split(".")[1], ScoreMap(shape))


class MLP(nn.Module):
    """Parameters of the feed-forward layer (computed by `mlp`)."""

    def __init__(self, shapes: Shapes) -> None:
        super().__init__()
        self.c_fc = _linear(shapes, "mlp.c_fc")
        if "mlp.c_gate.weight" in shapes:
            self.c_gate = _linear(shapes, "mlp.c_gate")
        self.c_proj = _linear(shapes, "mlp.c_proj")


class Block(nn.Module):
    """Parameters of a pre-norm transformer block (computed by `block`), laid out as `block_shapes` says."""

    def __init__(self, config: GPTConfig, shapes: Shapes) -> None:
        super().__init__()
        self.ln_1 = _norm(config, shapes, "ln_1")
        self.attn = CausalSelfAttention(config, shapes)
        self.ln_2 = _norm(config, shapes, "ln_2")
        self.mlp = MLP(shapes)


class GPT(nn.Module):
    """Token (+ learned position) embeddings, n_layer pre-norm blocks, final norm, LM head.

    With `lora`, the base weights are frozen (but for those it trains whole) and each targeted linear layer of
    every block holds a trainable `lora_A` and `lora_B` beside its weight (minigpt.model.lora), the embedding (and
    an untied head) a trainable `added` block of the rows past the base vocabulary: `config` is the adapted
    model's shape.
    """

    def __init__(self, config: GPTConfig, lora: LoRAConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.lora = lora
        # what a weights file holds (a LoRA model's base: the new rows are the adapter's); blocks follow
        # block_shapes
        shapes = expected_shapes(base_config(config, lora) if lora is not None else config)
        vocab, width = shapes["transformer.wte.weight"]
        modules: dict[str, nn.Module] = {"wte": nn.Embedding(vocab, width)}
        if "transformer.wpe.weight" in shapes:
            modules["wpe"] = nn.Embedding(*shapes["transformer.wpe.weight"])
        block = block_shapes(config)
        modules["h"] = nn.ModuleList(Block(config, block) for _ in range(config.n_layer))
        modules["ln_f"] = _norm(config, shapes, "transformer.ln_f")
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        if "skip_weights" in shapes:
            self.skip_weights = nn.Parameter(torch.empty(shapes["skip_weights"]))
        if lora is not None:
            self._add_adapters(lora)
        self.reset_parameters()

    def _add_adapters(self, lora: LoRAConfig) -> None:
        """Freeze the base weights and give the targeted layers (and the new rows) trainable parameters."""
        self.requires_grad_(False)
        for name in lora.whole:
            self.get_parameter(name).requires_grad_(True)
        for block_module in self.transformer.h:
            for target in lora.targets:
                layer = block_module.get_submodule(target)
                layer.lora_A = nn.Parameter(torch.empty(lora.rank, layer.in_features))
                layer.lora_B = nn.Parameter(torch.empty(layer.out_features, lora.rank))
        if lora.new_rows:
            heads = [self.transformer.wte] + ([] if self.config.tie_embeddings else [self.lm_head])
            for module in heads:
                module.added = nn.Parameter(torch.empty(lora.new_rows, self.config.n_embd))

    @classmethod
    def uninitialized(cls, config: GPTConfig, lora: LoRAConfig | None = None) -> GPT:
        """A GPT with allocated but uninitialised weights, fast to build when loaded weights replace them."""
        with _skip_init():
            return cls(config, lora)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer); U-net skip
        weights 1 (modded-nanogpt's); LoRA's A as nn.Linear's default (uniform within 1/sqrt(in)) and B zero,
        so an adapter starts as no change. Score maps, then value embeddings (N(0, 0.02)) are drawn last, so
        a seed gives the other weights whatever the score and with or without value embeddings."""
        named = sorted(self.named_parameters(), key=lambda item: _init_order(item[0]))
        for name, p in named:
            if ".attn.score" in name:
                _init_score_map(name, p)
            else:
                _initialise(name, p, self.config.n_layer)

    @torch.no_grad()
    def reset_adapters(self) -> None:
        """Initialise only the LoRA adapter's tensors (the base weights loaded into an uninitialized model)."""
        for name, p in self.named_parameters():
            if is_adapter_tensor(name):
                _initialise(name, p, self.config.n_layer)

    @torch.no_grad()
    def zero_output_projections(self) -> None:
        """Zero every block's output projections (attention's and the MLP's c_proj) and an untied head,
        so each block starts as the identity and the first logits are uniform (modded-nanogpt's init)."""
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or (
                name == "lm_head.weight" and not self.config.tie_embeddings
            ):
                p.zero_()

    def num_params(self) -> int:
        """Parameters the module holds, a tied tensor counted once."""
        return sum(p.numel() for p in self.parameters())

    def weights(self) -> ModelWeights[torch.Tensor]:
        """The parameters as the named tree the forward pass reads (the tensors themselves, not copies).

        It holds the parameter objects of this moment: in-place updates (training steps) show through,
        parameters replaced afterwards (load_state_dict(assign=True)) do not: read it again then.
        """
        tensors = dict(self.named_parameters())
        if self.lora is None:
            return weights_by_name(self.config, tensors)
        # the new rows join the frozen ones on every call, so their gradient reaches `added`
        return weights_by_name(self.config, join_added_rows(tensors, torch.cat), self.lora.scale)

    def new_cache(self, batch: int, dtype: torch.dtype | None = None) -> Cache:
        """An empty KV cache of `batch` rows, each layer as long as its window, in `dtype` (None: the
        model's) on the model's device."""
        c = self.config
        w = self.transformer.wte.weight
        shapes = [(batch, c.kv_heads, window, c.head_dim) for window in c.layer_windows]
        keys, values = (
            [w.new_zeros(s, dtype=dtype) for s in shapes],
            [w.new_zeros(s, dtype=dtype) for s in shapes],
        )
        return KVCache(keys, values, c.block_size if c.pos == "learned" else None, torch.cat)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        kv_cache: Cache | None = None,
        all_logits: bool = False,
        attention: list[torch.Tensor] | None = None,
        weights: ModelWeights[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Return (logits, loss): training, prefill and single-token decoding all run through here.

        With targets (B, T): (None, the mean cross-entropy; targets of -1 are ignored), from head_loss,
        which never holds the logits whole.
        Without: logits of the last position only, (B, V), unless all_logits asks for (B, T, V).
        With a kv_cache, idx holds only the new tokens, placed after kv_cache.pos cached ones.
        With an `attention` list, every layer appends its attention probabilities (B, H, T, pos + T).
        `weights`: this model's `weights()`, read once by a caller that steps many times.
        """
        w = self.weights() if weights is None else weights
        dropout = self.config.dropout if self.training else 0.0
        x = transformer(w, idx, kv_cache, attention, dropout)
        if targets is not None:
            return None, head_loss(w, x, targets)
        return head(w, x if all_logits else x[:, -1, :]), None


def _init_order(name: str) -> int:
    """0 for most parameters, 1 for a score map, 2 for a value embedding: the order they are drawn in."""
    return 2 if name.endswith("v_embed.weight") else int(".attn.score" in name)


def _init_score_map(name: str, p: torch.Tensor) -> None:
    """general's W starts as the identity, so general starts as dot and the runs differ by what training does
    with W; additive's maps start at N(0, 1/fan_in) (LeCun), keeping tanh's inputs at the scale of the
    queries and keys and the scores at the scale of tanh's outputs."""
    if name.endswith("attn.score.weight"):
        p.copy_(torch.eye(p.size(-1)).expand_as(p))
    else:
        nn.init.normal_(p, mean=0.0, std=p.size(-1) ** -0.5)


def _initialise(name: str, p: nn.Parameter, n_layer: int) -> None:
    if name.endswith("lora_A"):
        bound = 1.0 / math.sqrt(p.size(1))
        nn.init.uniform_(p, -bound, bound)
    elif name.endswith("lora_B"):
        nn.init.zeros_(p)
    elif name.endswith("c_proj.weight"):
        nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
    elif p.dim() >= 2:
        nn.init.normal_(p, mean=0.0, std=0.02)
    elif name.endswith("bias"):
        nn.init.zeros_(p)
    else:  # LayerNorm gains
        nn.init.ones_(p)


def model_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """What a checkpoint of the model holds: its state dict with GPT-2 names, the tied head left out (it is
    wte); for a model with LoRA adapters, the adapter's tensors only (the base stays in its own run)."""
    if model.lora is not None:
        whole = model.lora.whole
        return {n: p for n, p in model.named_parameters() if is_adapter_tensor(n) or n in whole}
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def build_model(
    config: GPTConfig, tensors: dict[str, torch.Tensor], source: Path, device: str = "cpu"
) -> GPT:
    """Build a GPT from stored tensors, checking names and shapes, without a wasted random init."""
    check_shapes(config, {k: tuple(v.shape) for k, v in tensors.items()}, source)
    model = GPT.uninitialized(config)
    state = {k: v.float() for k, v in tensors.items()}
    if config.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    return model.to(device)


# --- the computation, written once --------------------------------------------------------------------


def _dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    return F.dropout(x, p) if p else x  # inference passes p=0: not even a call


def norm(w: NormWeights[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if w.rms:
        return F.rms_norm(x, (x.size(-1),), w.weight, w.eps)
    return F.layer_norm(x, (x.size(-1),), w.weight, w.bias, w.eps)


def linear(w: LinearWeights[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if w.scale is None:  # an input-major weight (a decoding engine's layout) is the transpose of torch's
        y = F.linear(x, w.weight.t() if w.input_major else w.weight, w.bias)
        if w.lora is not None:
            # the scale goes on the rank-r product, and the update is added in place (linear's backward
            # needs its input, not its output): one full-width temporary, not three
            low = w.lora
            y = y.add_(F.linear(F.linear(x, low.a) * low.scale, low.b))
        return y
    # int8 weight-only (minigpt.model.quantize): the kernel takes activations in the scales' dtype, bf16 for
    # float32 models because its float32 path is several times slower; results return to x's dtype
    y = torch._weight_int8pack_mm(x.reshape(-1, x.size(-1)).to(w.scale.dtype), w.weight, w.scale)
    y = y.view(*x.shape[:-1], -1)
    return y.to(x.dtype) if w.bias is None else w.bias + y  # the sum promotes to the bias's dtype, x's


def rotary(base: float, head_dim: int, start: int, length: int, device: torch.device) -> Rotary:
    """cos and sin (length, head_dim) of the rotary angles of positions start..start+length.

    Dimension i and i + head_dim/2 turn together at frequency base^(-2i/head_dim), the pairing (and
    float32 arithmetic) of Hugging Face's Llama, so converted weights need no permutation.
    """
    return rotary_at(base, head_dim, torch.arange(start, start + length, device=device, dtype=torch.int64))


def rotary_at(base: float, head_dim: int, positions: torch.Tensor) -> Rotary:
    """`rotary` at any positions (an integer tensor): cos and sin of shape positions.shape + (head_dim,)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim
    angles = positions.float()[..., None] * (1.0 / base**exponents)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, rope: Rotary) -> torch.Tensor:
    """x (B, H, T, hd) turned by its positions' angles: q·k then depends only on their distance."""
    cos, sin = (t.to(x.dtype) for t in rope)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def attention_mask(queries: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """(queries, keys) booleans, True where a query may see a key: the keys are the latest positions in
    order and the queries the last of them; each sees itself and the window - 1 positions before it."""
    offset = keys - queries
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=device)
    return allowed.tril(diagonal=offset).triu(diagonal=offset - window + 1)


def qkv(
    w: AttentionWeights[torch.Tensor],
    x: torch.Tensor,
    rope: Rotary | None = None,
    idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Project x (B, T, C) to queries (B, H, T, hd) and keys and values (B, n_kv_head, T, hd), with
    QK-norm, rotary positions and the value embeddings of the tokens idx (B, T) applied when the model
    has them."""
    B, T, _ = x.shape
    hd = x.size(-1) // w.n_head
    q, k, v = linear(w.c_attn, x).split([w.n_head * hd, w.n_kv_head * hd, w.n_kv_head * hd], dim=-1)
    if w.v_embed is not None and idx is not None:
        v = v + F.embedding(idx, w.v_embed).to(v.dtype)
    q = q.view(B, T, w.n_head, hd).transpose(1, 2)
    k = k.view(B, T, w.n_kv_head, hd).transpose(1, 2)
    v = v.view(B, T, w.n_kv_head, hd).transpose(1, 2)
    if w.score == "general":  # W acts on the projected queries, so it folds into W_Q
        q = q @ w.score_maps[0].mT
    if w.q_norm is not None and w.k_norm is not None:
        q, k = norm(w.q_norm, q), norm(w.k_norm, k)
    if rope is not None:
        q, k = rotate(q, rope), rotate(k, rope)
    return q, k, v


def as_cached(dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """New keys and values in a cache's type: float16 rounds them (clamped to its largest finite value
    first, so that a huge key is a large score rather than inf), as `minigpt.generate.engines.numpy_engine.as_cached`."""
    if dtype == k.dtype:
        return k, v
    if dtype == torch.float16:
        top = torch.finfo(torch.float16).max
        k, v = k.clamp(-top, top), v.clamp(-top, top)
    return k.to(dtype), v.to(dtype)


def attend(
    w: AttentionWeights[torch.Tensor],
    x: torch.Tensor,
    layer: int,
    cache: Cache | None = None,
    rope: Rotary | None = None,
    attention: list[torch.Tensor] | None = None,
    dropout: float = 0.0,
    idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal self-attention of x (B, T, C) over itself and, with a cache, the positions cached before,
    each query seeing at most the layer's window (idx: the tokens, for value embeddings).

    Fused SDPA for the dot-product scores (scaled, dot, general); with an `attention` list, or for the
    additive score, it computes softmax(logits) explicitly (masked first) and appends the probabilities
    (B, H, T, keys) to the list, so inspection reads the very attention the model runs.
    """
    B, T, C = x.shape
    q, k, v = qkv(w, x, rope, idx)
    seen = None  # rows at different positions: (B, 1, 1, keys), the cache slots each row has filled
    if cache is not None:  # a cache in another type (float16) stores the keys and values rounded to it
        k, v = cache.update(layer, *as_cached(cache.k[layer].dtype, k, v))
        k, v = k.to(q.dtype), v.to(q.dtype)
        if (filled := cache.key_mask(layer)) is not None:
            seen = torch.from_numpy(filled).to(x.device)[:, None, None, :]
    if attention is None and w.score != "additive":
        y = _fused_attention(q, k, v, w.window, dropout, None if w.score == "scaled" else 1.0, seen)
    else:
        groups = w.n_head // w.n_kv_head
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = attention_logits(w, q, k)
        if T > 1:
            scores = scores.masked_fill(~attention_mask(T, k.size(2), w.window, x.device), float("-inf"))
        elif seen is not None:
            scores = scores.masked_fill(~seen, float("-inf"))
        probs = scores.softmax(dim=-1)
        if attention is not None:
            attention.append(probs)
        y = _dropout(probs, dropout).to(v.dtype) @ v
    # reshape is a view, not a copy, for a single new token
    return _dropout(linear(w.c_proj, y.transpose(1, 2).reshape(B, T, C)), dropout)


# torch's CPU attention kernel in bf16 is slow over few keys: forward and backward at 128 keys and head size 32
# took 1.9-2.3x as long as in float32 (the inputs cast up and the output down included), 2.7-4x at 64 keys
# or head size 16, level at 256-512 keys, faster from 1,024 (bench/bench_cpu_bf16.py). So on the CPU,
# attention in half precision (autocast, or a bf16 model) over at most this many keys runs in float32: bf16
# training of the CPU recipe's model then takes 1.33x fewer seconds a step than float32 instead of the same
# (README: Benchmarks, round 5)
CPU_HALF_ATTENTION_MAX_KEYS = 256


def _fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    dropout: float,
    scale: float | None,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch's fused attention of q over k and v (`seen`: the cache slots each row may see, for rows at
    different positions), in float32 where CPU_HALF_ATTENTION_MAX_KEYS says so."""
    T, S = q.size(2), k.size(2)
    half = q.dtype in (torch.bfloat16, torch.float16)
    if q.device.type == "cpu" and half and S <= CPU_HALF_ATTENTION_MAX_KEYS:
        with torch.autocast("cpu", enabled=False):
            y = _fused_attention(q.float(), k.float(), v.float(), window, dropout, scale, seen)
        return y.to(q.dtype)
    gqa = k.size(1) != q.size(1)
    # one new query sees every key the cache hands back (it keeps only the layer's window; rows at
    # different positions: the slots `seen` marks); T queries over T keys within the window are plain
    # causal attention
    if T == 1 or (S == T and window >= T):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=seen, dropout_p=dropout, is_causal=T > 1, scale=scale, enable_gqa=gqa
        )
    # SDPA's is_causal aligns the mask top-left, wrong when queries start after cached keys
    mask = attention_mask(T, S, window, q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa
    )


def attention_logits(w: AttentionWeights[torch.Tensor], q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Logits (B, H, T, S), float32 or wider, of the queries q (B, H, T, hd) over the keys k (B, H, S, hd,
    one head per query head) by the layer's score: q·k/√hd, q·k (dot; general, whose W qkv applied), or additive's
    vᵀtanh(W₁q + W₂k), left -inf where no query of a chunk may look (the caller masks the rest)."""
    dtype = torch.promote_types(q.dtype, torch.float32)  # half precision upcast; a float64 model stays
    if w.score == "additive":
        maps = tuple(m.to(dtype) for m in w.score_maps)
        return _additive_logits(q.to(dtype), k.to(dtype), maps, w.window)
    logits = q.to(dtype) @ k.to(dtype).transpose(-2, -1)
    return logits / math.sqrt(q.size(-1)) if w.score == "scaled" else logits


def _additive_logits(
    q: torch.Tensor, k: torch.Tensor, maps: tuple[torch.Tensor, ...], window: int
) -> torch.Tensor:
    """vᵀtanh(W₁q + W₂k) of every query and key, materialising the B·H·T·S·d_a pre-activations a chunk
    of queries at a time (`memory.score_chunks`). Under autograd each chunk is recomputed in the backward
    pass (checkpoint) rather than kept, so a training step holds one chunk's values, not every chunk's."""
    w1, w2, v = maps
    qa, ka = q @ w1.mT, (k @ w2.mT).unsqueeze(2)  # (B, H, T, d_a), (B, H, 1, S, d_a)
    B, H, T, da = qa.shape
    logits = qa.new_full((B, H, T, ka.size(3)), float("-inf"))
    grad = torch.is_grad_enabled() and (qa.requires_grad or ka.requires_grad)
    for t0, t1, k0, k1 in score_chunks(T, ka.size(3), window, B * H * da):
        part = (qa[:, :, t0:t1], ka[:, :, :, k0:k1], v)
        logits[:, :, t0:t1, k0:k1] = (
            checkpoint(_additive_chunk, *part, use_reentrant=False) if grad else _additive_chunk(*part)
        )
    return logits


def _additive_chunk(qa: torch.Tensor, ka: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """vᵀtanh(qa + ka) for queries qa (B, H, Tc, d_a) and keys ka (B, H, 1, S, d_a): (B, H, Tc, S)."""
    pre = qa.unsqueeze(3) + ka  # (B, H, Tc, S, d_a): the memory `score_chunks` bounds
    return (pre.tanh_() @ v.mT.unsqueeze(1)).squeeze(-1)


def mlp(w: MLPWeights[torch.Tensor], x: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
    h = linear(w.c_fc, x)
    if w.activation == "gelu":
        # the tanh form is GPT-2's gelu_new, so imported weights give exactly GPT-2's outputs
        h = F.gelu(h, approximate="tanh")
    elif w.activation == "relu2":
        h = F.relu(h).square()
    elif w.fused_gate:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    elif w.c_gate is not None:
        h = F.silu(linear(w.c_gate, x)) * h
    return _dropout(linear(w.c_proj, h), dropout)


def block(
    w: BlockWeights[torch.Tensor],
    x: torch.Tensor,
    layer: int,
    cache: Cache | None = None,
    rope: Rotary | None = None,
    attention: list[torch.Tensor] | None = None,
    dropout: float = 0.0,
    idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""
    x = x + attend(w.attn, norm(w.ln_1, x), layer, cache, rope, attention, dropout, idx)
    return x + mlp(w.mlp, norm(w.ln_2, x), dropout)


def transformer(
    w: ModelWeights[torch.Tensor],
    idx: torch.Tensor,
    cache: Cache | None = None,
    attention: list[torch.Tensor] | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Final hidden states (B, T, C) of the tokens idx (B, T), placed after cache.pos cached ones."""
    T = idx.size(1)
    start = first_position(cache, T, None if w.wpe is None else w.wpe.size(0))
    x = F.embedding(idx, w.wte)
    rope = None
    if isinstance(start, int):
        if w.wpe is not None:
            x = x + w.wpe[start : start + T]
        if w.rope_base is not None:
            rope = rotary(w.rope_base, w.head_dim, start, T, x.device)
    else:  # rows at different positions, one token each: (B, 1) positions
        ids = torch.from_numpy(position_ids(start, T)).to(x.device)
        if w.wpe is not None:
            x = x + w.wpe[ids]
        if w.rope_base is not None:
            cos, sin = rotary_at(w.rope_base, w.head_dim, ids)
            rope = (cos[:, None], sin[:, None])  # (B, 1, 1, hd), as x's (B, H, T, hd)
    x = _dropout(x, dropout)
    inputs: list[torch.Tensor] = []  # the layers' inputs that U-net skips carry to later layers
    takes = {taker: (i, giver) for i, (giver, taker) in enumerate(w.skip_pairs)}
    for layer, b in enumerate(w.h):
        if layer in takes and w.skips is not None:
            i, giver = takes[layer]
            x = x + w.skips[i].to(x.dtype) * inputs[giver]
        if layer < len(w.skip_pairs):
            inputs.append(x)
        x = block(b, x, layer, cache, rope, attention, dropout, idx)
    if cache is not None:
        cache.advance(T)
    return norm(w.ln_f, x)


HEAD_LOSS_ELEMENTS = 1 << 22  # logits per chunk of rows in head_loss on the CPU (16 MB in float32)
# on a GPU: 512 MB of float32 logits (2 GB with their softmax and gradient). A chunk of 16 MB is 83 rows of
# GPT-2's vocabulary: a batch of 32 x 1,024 took 395 chunks, each adding its head gradient into a float32
# copy of the head (154 MB read and written per chunk) and launching a dozen kernels: GPT-2 124M trained
# at 76k tokens/s on an H200 against 183k with this chunk (README: "GPU")
ACCELERATOR_HEAD_LOSS_ELEMENTS = 1 << 27
# the head's products run on a vocabulary padded with zero rows to a multiple of this (its logits -inf), by
# device type: a GPU's matrix kernels need 16-byte aligned rows, and at GPT-2's 50,257 tokens cuBLAS fell
# back to kernels of an older generation that ran the head's three products at about 120 TFLOP/s on an
# H200, against about 760 at 50,304 (bench/bench_gpu.py, twice); the CPU's BLAS has no such cliff
HEAD_ROW_MULTIPLE = {"cpu": 1}
ACCELERATOR_HEAD_ROW_MULTIPLE = 128


def head_loss(w: ModelWeights[torch.Tensor], x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the head's logits of hidden states x (B, T, C) against targets (B, T;
    -1 is not predicted), F.cross_entropy's value, computed a chunk of rows at a time with its gradients
    (_HeadLoss): the (B x T, V) logits, their softmax and their gradient, three times 200 MB for a batch
    of 16 x 64 over GPT-2's 50,257 tokens, never exist whole."""
    rows = x.reshape(-1, x.size(-1))
    gpu = x.device.type != "cpu"
    elements = ACCELERATOR_HEAD_LOSS_ELEMENTS if gpu else HEAD_LOSS_ELEMENTS
    multiple = HEAD_ROW_MULTIPLE.get(x.device.type, ACCELERATOR_HEAD_ROW_MULTIPLE)
    chunk = max(1, elements // w.lm_head.size(0))
    # forward() runs with grad mode off, so whether gradients are wanted (not in an evaluation) is read here
    grads = torch.is_grad_enabled() and (rows.requires_grad or w.lm_head.requires_grad)
    return _HeadLoss.apply(rows, w.lm_head, targets.reshape(-1), w.logit_cap, chunk, grads, multiple)


class _HeadLoss(torch.autograd.Function):
    """Cross-entropy through the LM head, its gradients computed in the forward pass, chunk by chunk
    (the softmax minus the one-hot target is the logits' gradient), so backward only scales them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        cap: float | None,
        chunk: int,
        grads: bool,
        multiple: int,
    ) -> torch.Tensor:
        wanted = targets >= 0
        count = wanted.sum()
        vocab = weight.size(0)
        ctx.weight_dtype = weight.dtype  # type: ignore[attr-defined]
        wide = torch.promote_types(weight.dtype, torch.float32)  # sums in float32 at least
        # zero rows, their logits set to -inf
        padded = F.pad(weight, (0, 0, 0, -vocab % multiple)) if vocab % multiple else weight
        gx = torch.zeros_like(x) if grads else None
        gw = torch.zeros_like(padded, dtype=wide) if grads else None
        total = torch.zeros((), dtype=wide, device=x.device)
        for start in range(0, x.size(0), chunk):
            part = slice(start, start + chunk)
            loss, g = _chunk_loss(x[part], padded, vocab, targets[part], wanted[part], cap, wide, grads)
            total += loss
            if g is not None:
                gx[part] = (g.to(weight.dtype) @ padded).to(x.dtype)
                gw += (g.t().to(x.dtype) @ x[part]).to(wide)
        ctx.save_for_backward(gx, None if gw is None else gw[:vocab], count)
        return total / count

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        gx, gw, count = ctx.saved_tensors  # type: ignore[attr-defined]
        scale = grad / count
        return gx * scale.to(gx.dtype), (gw * scale).to(ctx.weight_dtype), None, None, None, None, None


def _chunk_loss(
    xs: torch.Tensor,
    weight: torch.Tensor,
    vocab: int,
    targets: torch.Tensor,
    ok: torch.Tensor,
    cap: float | None,
    wide: torch.dtype,
    grads: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The summed cross-entropy of one chunk of rows against `weight`'s first `vocab` rows (any rows after
    them take no part), and the gradient of that sum with respect to the logits (None unless `grads`)."""
    z = F.linear(xs, weight).to(wide)
    capped = None if cap is None else torch.tanh(z / cap)
    logits = z if capped is None else cap * capped
    if logits.size(1) > vocab:
        logits[:, vocab:] = float("-inf")  # padding: no probability, no gradient
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    loss = torch.where(ok, lse - picked, 0.0).sum()
    if not grads:
        return loss, None
    g = torch.exp(logits - lse[:, None])  # softmax, minus the target's one-hot below
    g.scatter_add_(1, targets.clamp(min=0)[:, None], -ok[:, None].to(g.dtype))
    g *= ok[:, None]
    if capped is not None:
        g *= 1 - capped * capped  # through cap * tanh(z / cap)
    return loss, g


def head(w: ModelWeights[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The logits of hidden states x: the LM head, soft-capped when the model caps them."""
    logits = F.linear(x, w.lm_head)
    if w.logit_cap is None:
        return logits
    return w.logit_cap * torch.tanh(logits / w.logit_cap)
