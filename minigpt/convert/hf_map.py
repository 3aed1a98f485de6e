"""The Hugging Face models minigpt maps to (GPT-2, Llama, Qwen3): their configs and tensor names, no I/O."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minigpt.common.strict_json import JsonError, checked_int, checked_number, preview
from minigpt.errors import MinigptError
from minigpt.model.config import MAX_WINDOW_PATTERN, GPTConfig
from minigpt.model.weights import expected_shapes

if TYPE_CHECKING:
    import torch

# model_type -> the transformers class save_pretrained names in config.json, and the family's name
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
LABELS = {"gpt2": "GPT-2", "llama": "Llama", "qwen3": "Qwen3"}

# HF's GPT-2 Conv1D stores (in, out); nn.Linear stores (out, in)
_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# tensors some checkpoints carry that are not weights: GPT-2's causal-mask buffers, old Llama's rotary
# frequencies (both recomputed by the model)
_IGNORED = {
    "gpt2": re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$"),
    "llama": re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$"),
}
_IGNORED["qwen3"] = _IGNORED["llama"]
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # the same function; minigpt's GELU(approximate="tanh")
# layers an imported config may claim: far past the deepest checkpoint, checked before anything is listed
# per layer (a config.json claiming 10**9 would otherwise be), and so any pattern of them fits window_pattern
MAX_LAYERS = MAX_WINDOW_PATTERN
_FIX = "correct config.json, or download the model again"

# minigpt module -> Llama/Qwen3 module(s); the fused query/key/value projection is three there, in row order
_LLAMA_LAYER: dict[str, tuple[str, ...]] = {
    "ln_1": ("input_layernorm",),
    "attn.c_attn": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.c_proj": ("self_attn.o_proj",),
    "attn.q_norm": ("self_attn.q_norm",),
    "attn.k_norm": ("self_attn.k_norm",),
    "ln_2": ("post_attention_layernorm",),
    "mlp.c_gate": ("mlp.gate_proj",),
    "mlp.c_fc": ("mlp.up_proj",),
    "mlp.c_proj": ("mlp.down_proj",),
}
_LLAMA_TOP = {"transformer.wte": "model.embed_tokens", "transformer.ln_f": "model.norm", "lm_head": "lm_head"}
_LAYER_NAME = re.compile(r"^transformer\.h\.(\d+)\.(.+)\.(weight|bias)$")


# ---------------------------------------------------------------- which model a config maps to

Check = tuple[bool, str, str]  # (the config has a problem, the option as a flag, why transformers lacks it)


_SCALED_ONLY = "GPT-2, Llama and Qwen3 score attention by the scaled dot product only (--attn-score scaled)"


def _has_windows(c: GPTConfig) -> bool:
    return any(w < c.block_size for w in c.layer_windows)


def _gpt2_checks(c: GPTConfig) -> list[Check]:
    why = "learned positions map only to GPT-2, which lacks it (Llama and Qwen3 need --pos rope)"
    return [
        (c.norm != "layernorm", f"--norm {c.norm}", why),
        (c.mlp != "gelu", f"--mlp {c.mlp}", why),
        (c.qk_norm, "--qk-norm", why),
        (c.kv_heads != c.n_head, f"--n-kv-head {c.kv_heads}", why),
        (_has_windows(c), f"--window {c.window}", why),
        (c.d_ff != 4 * c.n_embd, f"an MLP width of {c.d_ff}", "GPT-2's MLP is 4 x n_embd wide"),
        (not c.bias, "no biases (--no-bias)", "GPT-2 always has them, so GPT2LMHeadModel cannot hold it"),
    ]


def _rotary_checks(c: GPTConfig) -> list[Check]:
    why = "rotary models map to LlamaForCausalLM or Qwen3ForCausalLM, which take --norm rmsnorm --mlp swiglu"
    checks = [(c.norm != "rmsnorm", f"--norm {c.norm}", why), (c.mlp != "swiglu", f"--mlp {c.mlp}", why)]
    if c.qk_norm:
        return [
            *checks,
            (
                c.bias,
                "biases (--bias)",
                "Qwen3ForCausalLM (--qk-norm) has no MLP biases (--qk-norm without --bias leaves them out)",
            ),
        ]
    why = "LlamaForCausalLM has no local attention (Qwen3ForCausalLM, for --qk-norm models, has)"
    return [*checks, (_has_windows(c), f"--window {c.window}", why)]


def _speedrun_checks(c: GPTConfig) -> list[Check]:
    why = "GPT-2, Llama and Qwen3 have no such part, so no runtime that reads them could run the model"
    return [
        (c.attn_score != "scaled", f"--attn-score {c.attn_score}", _SCALED_ONLY),
        (c.value_embeds, "--value-embeds", why),
        (c.skips, "--skips", why),
        (c.logit_cap is not None, f"--logit-cap {c.logit_cap}", why),
    ]


def family_for(config: GPTConfig, target: str = "Hugging Face") -> str:
    """The model_type a minigpt model converts to, or a one-line error naming the option none can hold
    (llama.cpp's gpt2, llama and qwen3 hold what these do: `target` names the format in the error)."""
    checks = _speedrun_checks(config)
    checks += _gpt2_checks(config) if config.pos == "learned" else _rotary_checks(config)
    for failed, option, why in checks:
        if failed:
            raise MinigptError(f"cannot convert to {target}: this model has {option}; {why}")
    if config.pos == "learned":
        return "gpt2"
    return "qwen3" if config.qk_norm else "llama"


# ---------------------------------------------------------------- config.json, both ways


def hf_config(config: GPTConfig, eot_id: int | None, eos_id: int | None = None) -> dict[str, Any]:
    """The transformers config (as config.json) of the model `config` maps to: `eot_id` begins and, unless
    `eos_id` is given (a chat run's end of turn), ends what it generates."""
    family = family_for(config)
    eot_id, eos_id = (i if i is not None and 0 <= i < config.vocab_size else None for i in (eot_id, eos_id))
    common = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id if eos_id is None else eos_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "float32",
    }
    return {**common, **(_gpt2_config(config) if family == "gpt2" else _llama_config(config, family))}


def _gpt2_config(config: GPTConfig) -> dict[str, Any]:
    return {
        "n_positions": config.block_size,
        "n_ctx": config.block_size,  # what GPT-2's own config.json has, and llama.cpp's converter reads
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "layer_norm_epsilon": config.layer_norm_eps,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
    }


def _llama_config(config: GPTConfig, family: str) -> dict[str, Any]:
    hf = {
        "hidden_size": config.n_embd,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.layer_norm_eps,
        # transformers 5 reads rope_parameters, 4.x the top-level rope_theta
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base},
        "rope_theta": config.rope_base,
        "attention_bias": config.bias,
        "attention_dropout": config.dropout,
    }
    if family == "llama":
        return {**hf, "mlp_bias": config.bias, "pretraining_tp": 1}
    sliding = [w < config.block_size for w in config.layer_windows]
    windows = {
        "use_sliding_window": any(sliding),
        "sliding_window": config.window if any(sliding) else None,
        "max_window_layers": config.n_layer,  # ignored where layer_types is given, as here
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
    }
    return {**hf, **windows}


def config_from_hf(hf: dict[str, Any], source: Path) -> GPTConfig:
    """The GPTConfig of a GPT-2, Llama or Qwen3 config.json; anything minigpt cannot express is an error.

    Absent keys take transformers' defaults for that model, as transformers itself would.
    """

    def get(key: str, default: Any) -> Any:
        value = hf.get(key, default)
        return default if value is None and default is not None else value

    reader = _gpt2_fields if hf.get("model_type") == "gpt2" else _llama_fields
    fields = reader(hf, get, source)
    try:
        return _defaults_unset(GPTConfig(dropout=0.0, **fields))  # inference-first: no dropout
    except (MinigptError, TypeError, ValueError) as e:
        raise MinigptError(f"{source}: not a usable {LABELS[hf['model_type']]} config ({e})") from None


def _defaults_unset(config: GPTConfig) -> GPTConfig:
    """`config` with n_kv_head and mlp_width left unset where they are what unset gives, as a run
    trained with the same shape saves them (so a round trip gives back the very config)."""
    if config.n_kv_head == config.n_head:
        config = replace(config, n_kv_head=None)
    if config.mlp_width is not None and replace(config, mlp_width=None).d_ff == config.mlp_width:
        config = replace(config, mlp_width=None)
    return config


Getter = Callable[[str, Any], Any]


def _field(source: Path, check: Callable[[], Any]) -> Any:
    """`check()`'s value, its JsonError (a field of the wrong type or size) a one-line MinigptError."""
    try:
        return check()
    except JsonError as e:
        raise MinigptError(f"{source}: {e}; {_FIX}") from None


def _count(get: Getter, key: str, default: int, source: Path, high: int = (1 << 63) - 1) -> int:
    """A field that counts something (a width, a number of layers): an integer from 1 to `high`."""
    return _field(source, lambda: checked_int(get(key, default), key, 1, high))


def _positive(get: Getter, key: str, default: float, source: Path) -> float:
    return _field(source, lambda: checked_number(get(key, default), key, positive=True))


def _gpt2_fields(hf: dict[str, Any], get: Getter, source: Path) -> dict[str, Any]:
    n_embd = _count(get, "n_embd", 768, source)
    n_inner = hf.get("n_inner")
    if n_inner is not None and n_inner != 4 * n_embd:
        raise MinigptError(
            f"{source}: n_inner {preview(n_inner)} is not 4 x n_embd ({4 * n_embd}); minigpt's MLP is 4 x n_embd wide"
        )
    act = get("activation_function", "gelu_new")
    if act not in _TANH_GELUS:
        raise MinigptError(
            f"{source}: activation_function {preview(act)} is not supported; minigpt uses GPT-2's gelu_new"
        )
    unsupported = {
        "scale_attn_weights": (get("scale_attn_weights", True), True),
        "scale_attn_by_inverse_layer_idx": (get("scale_attn_by_inverse_layer_idx", False), False),
        "add_cross_attention": (get("add_cross_attention", False), False),
    }
    for key, (value, wanted) in unsupported.items():
        if bool(value) != wanted:
            raise MinigptError(
                f"{source}: {key}={preview(value)} is not plain GPT-2 attention; minigpt cannot run it"
            )
    return dict(
        vocab_size=_count(get, "vocab_size", 50257, source),
        block_size=_count(get, "n_positions", 1024, source),
        n_layer=_count(get, "n_layer", 12, source, MAX_LAYERS),
        n_head=_count(get, "n_head", 12, source),
        n_embd=n_embd,
        bias=True,
        tie_embeddings=bool(get("tie_word_embeddings", True)),
        layer_norm_eps=_positive(get, "layer_norm_epsilon", 1e-5, source),
    )


def _llama_fields(hf: dict[str, Any], get: Getter, source: Path) -> dict[str, Any]:
    family = hf["model_type"]
    hidden, heads = _count(get, "hidden_size", 4096, source), _count(get, "num_attention_heads", 32, source)
    head_dim = hf.get("head_dim") or hidden // heads
    if head_dim != hidden // heads:
        raise MinigptError(
            f"{source}: head_dim {preview(head_dim)} is not hidden_size / num_attention_heads ({hidden} / {heads}); "
            f"minigpt's heads split the width evenly"
        )
    if get("hidden_act", "silu") != "silu":
        raise MinigptError(
            f"{source}: hidden_act {preview(hf['hidden_act'])} is not SwiGLU's silu; minigpt cannot run it"
        )
    bias = bool(get("attention_bias", False))
    mlp_bias = bool(get("mlp_bias", False)) if family == "llama" else False
    if bias != mlp_bias:
        raise MinigptError(
            f"{source}: attention_bias={bias} but mlp_bias={mlp_bias}; minigpt's --bias covers both"
        )
    return dict(
        vocab_size=_count(get, "vocab_size", 32000 if family == "llama" else 151936, source),
        block_size=_count(get, "max_position_embeddings", 2048 if family == "llama" else 32768, source),
        n_layer=_count(get, "num_hidden_layers", 32, source, MAX_LAYERS),
        n_head=heads,
        n_embd=hidden,
        n_kv_head=_count(get, "num_key_value_heads", heads, source),
        pos="rope",
        rope_base=_rope_theta(hf, source),
        norm="rmsnorm",
        mlp="swiglu",
        mlp_width=_count(get, "intermediate_size", 11008 if family == "llama" else 22016, source),
        qk_norm=family == "qwen3",
        bias=bias,
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        layer_norm_eps=_positive(get, "rms_norm_eps", 1e-6, source),
        **(_windows(hf, get, source) if family == "qwen3" else {}),
    )


def _rope_theta(hf: dict[str, Any], source: Path) -> Any:
    """The rotary base of plain (unscaled, full-width) rotary positions; anything else is an error."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise MinigptError(f"{source}: rope_parameters is not a JSON object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise MinigptError(
            f"{source}: rope_type {preview(kind)} (scaled rotary positions) is not minigpt's plain rotary"
        )
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise MinigptError(
            f"{source}: partial_rotary_factor {preview(partial)}: minigpt rotates every head dimension"
        )
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return _field(source, lambda: checked_number(theta, "rope_theta", positive=True))


def _windows(hf: dict[str, Any], get: Getter, source: Path) -> dict[str, Any]:
    """Qwen3's per-layer sliding windows as minigpt's window and shortest S/L pattern that gives them."""
    n_layer = _count(get, "num_hidden_layers", 32, source, MAX_LAYERS)
    if not get("use_sliding_window", False) or get("sliding_window", 4096) is None:
        return {}
    window = _count(get, "sliding_window", 4096, source)
    layers = _layer_kinds(hf, get, n_layer, source)
    if "S" not in layers:
        return {}
    if layers[-1] == "S":
        raise MinigptError(
            f"{source}: the last layer has a sliding window; minigpt's last layer attends to all"
        )
    period = _period(layers[:-1])  # the last layer is full, as minigpt's always is
    return {"window": window, "window_pattern": layers[:period]}


def _layer_kinds(hf: dict[str, Any], get: Getter, n_layer: int, source: Path) -> str:
    """Each layer's attention as S (a sliding window) or L (full): layer_types, else the layers from
    max_window_layers on sliding (transformers' rule), `n_layer` of them (already bounded)."""
    types = hf.get("layer_types")
    if not types:
        full = _field(source, lambda: checked_int(get("max_window_layers", 28), "max_window_layers"))
        return "L" * min(full, n_layer) + "S" * max(n_layer - full, 0)
    kinds = {"sliding_attention": "S", "full_attention": "L"}
    if (
        not isinstance(types, list)
        or len(types) != n_layer
        or not all(isinstance(t, str) and t in kinds for t in types)
    ):
        raise MinigptError(
            f"{source}: layer_types must list full_attention or sliding_attention for each of the "
            f"{n_layer} layers; {_FIX}"
        )
    return "".join(kinds[t] for t in types)


def _period(layers: str) -> int:
    """The shortest p with layers[i] == layers[i - p] throughout (so layers[:p] repeated gives them), in
    linear time: the length less the longest proper border (Knuth-Morris-Pratt's failure function)."""
    border = [0] * len(layers)
    k = 0
    for i in range(1, len(layers)):
        while k and layers[i] != layers[k]:
            k = border[k - 1]
        k += layers[i] == layers[k]
        border[i] = k
    return len(layers) - border[-1]


# ---------------------------------------------------------------- tensor names and layouts


def _is_conv1d(name: str) -> bool:
    return name.endswith(_CONV1D_SUFFIXES)


def _llama_names(name: str) -> tuple[str, ...]:
    layer = _LAYER_NAME.match(name)
    if layer is None:
        module, kind = name.rsplit(".", 1)
        return (f"{_LLAMA_TOP[module]}.{kind}",)
    i, module, kind = layer.groups()
    return tuple(f"model.layers.{i}.{part}.{kind}" for part in _LLAMA_LAYER[module])


def hf_names(config: GPTConfig, name: str) -> tuple[str, ...]:
    """The Hugging Face tensor(s) minigpt's tensor `name` is stored as, in row order."""
    return (name,) if family_for(config) == "gpt2" else _llama_names(name)


def qkv_rows(config: GPTConfig) -> list[int]:
    """Rows of the queries, keys and values in the fused attention projection (c_attn), in that order."""
    hd = config.head_dim
    return [config.n_head * hd, config.kv_heads * hd, config.kv_heads * hd]


def _row_split(config: GPTConfig, name: str) -> list[int]:
    """Rows of each part of a tensor stored as several: queries, keys, values of the fused projection."""
    return qkv_rows(config) if "c_attn" in name else []


def expected_hf_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> the shape its file stores it in (GPT-2's Conv1D weights transposed),
    for every tensor of the model (a tied head left out)."""
    gpt2 = family_for(config) == "gpt2"
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in expected_shapes(config).items():
        names = hf_names(config, name)
        rows = _row_split(config, name) if len(names) > 1 else [shape[0]]
        for hf_name, n in zip(names, rows, strict=True):
            part = (n, *shape[1:])
            shapes[hf_name] = part[::-1] if gpt2 and _is_conv1d(name) else part
    return shapes


def canonical_name(config: GPTConfig, hf_name: str) -> str | None:
    """The name `expected_hf_shapes` uses for a tensor a file holds; None for tensors that are not weights.
    GPT2LMHeadModel's save_pretrained prefixes "transformer."; GPT2Model and the original hub files do not."""
    family = family_for(config)
    if _IGNORED[family].match(hf_name):
        return None
    if family == "gpt2" and hf_name != "lm_head.weight" and not hf_name.startswith("transformer."):
        return "transformer." + hf_name
    return hf_name


def to_hf_tensors(config: GPTConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """minigpt's tensors (GPT-2 names, Linear layout) under the Hugging Face model's names and layout."""
    gpt2 = family_for(config) == "gpt2"
    out = {}
    for name, t in tensors.items():
        names = hf_names(config, name)
        t = t.t() if gpt2 and _is_conv1d(name) else t
        parts = t.split(_row_split(config, name)) if len(names) > 1 else (t,)
        out.update({n: p.contiguous() for n, p in zip(names, parts, strict=True)})
    return out


def from_hf_tensors(config: GPTConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `to_hf_tensors`: minigpt's float32 tensors from the Hugging Face ones (canonical
    names, as `expected_hf_shapes` lists them)."""
    import torch

    gpt2 = family_for(config) == "gpt2"
    out = {}
    for name in expected_shapes(config):
        parts = [tensors[n].float() for n in hf_names(config, name)]
        t = torch.cat(parts) if len(parts) > 1 else parts[0]
        out[name] = t.t().contiguous() if gpt2 and _is_conv1d(name) else t
    return out


def short_list(names: Iterable[str]) -> str:
    names = sorted(names)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
