"""Shapes of a decoder-only checkpoint, read from its config.json alone (no weights loaded).

The quantizers' up-front checks (does the group size divide every input dimension?) and the
memory planner (how many bytes do weights, Hessians and the KV cache take?) both need the same
few numbers, so they are derived here once. Covers two layouts: the Llama family's (Llama, Mistral,
Qwen2/3, SmolLM: q/k/v/o attention projections with grouped-query attention and a gated MLP
gate/up/down), and GPT-2's (`n_embd`, `n_layer`…: one fused c_attn, an ungated c_fc/c_proj MLP,
biases and learned position embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.core.errors import BadInput


@dataclass(frozen=True)
class Linear:
    """One linear projection inside every decoder layer (`name` relative to the layer)."""

    name: str
    in_features: int
    out_features: int
    in_from: str  # which config value sets in_features, for error messages

    @property
    def params(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class DecoderShapes:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3 normalizes q and k per head (two head_dim vectors per layer)
    layout: str = "llama"  # or "gpt2"
    positions: int = 0  # learned position embeddings (GPT-2's wpe); 0 for rotary models

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DecoderShapes:
        if config.get("model_type") == "gpt2" or "n_embd" in config:
            return cls._gpt2(config)
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                               "intermediate_size", "vocab_size") if k not in config]
        if missing:
            raise BadInput(f"config.json: missing {', '.join(missing)}; kiln reads decoder shapes from "
                           "the Llama-family fields (model_type llama, mistral, qwen2, qwen3) or GPT-2's.")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=hidden,
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            qk_norm=config.get("model_type") == "qwen3",
        )

    @classmethod
    def _gpt2(cls, config: dict[str, Any]) -> DecoderShapes:
        missing = [k for k in ("n_layer", "n_embd", "n_head", "vocab_size") if k not in config]
        if missing:
            raise BadInput(f"config.json: missing {', '.join(missing)} of a GPT-2 config.")
        hidden, heads = int(config["n_embd"]), int(config["n_head"])
        return cls(layers=int(config["n_layer"]), hidden=hidden, heads=heads, kv_heads=heads, head_dim=hidden // heads,
                   intermediate=int(config.get("n_inner") or 4 * hidden), vocab=int(config["vocab_size"]),
                   tied_embeddings=bool(config.get("tie_word_embeddings", True)), attention_bias=True,
                   layout="gpt2", positions=int(config.get("n_positions", 1024)))

    @property
    def layer_prefix(self) -> str:
        return "transformer.h" if self.layout == "gpt2" else "model.layers"

    def linears(self) -> list[Linear]:
        if self.layout == "gpt2":  # Conv1D modules, but the same in -> out shapes
            return [Linear("attn.c_attn", self.hidden, 3 * self.hidden, "n_embd"),
                    Linear("attn.c_proj", self.hidden, self.hidden, "n_embd"),
                    Linear("mlp.c_fc", self.hidden, self.intermediate, "n_embd"),
                    Linear("mlp.c_proj", self.intermediate, self.hidden, "n_inner")]
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [
            Linear("self_attn.q_proj", self.hidden, q_out, "hidden_size"),
            Linear("self_attn.k_proj", self.hidden, kv_out, "hidden_size"),
            Linear("self_attn.v_proj", self.hidden, kv_out, "hidden_size"),
            Linear("self_attn.o_proj", q_out, self.hidden, "num_attention_heads × head_dim"),
            Linear("mlp.gate_proj", self.hidden, self.intermediate, "hidden_size"),
            Linear("mlp.up_proj", self.hidden, self.intermediate, "hidden_size"),
            Linear("mlp.down_proj", self.intermediate, self.hidden, "intermediate_size"),
        ]

    def module_names(self) -> list[str]:
        """Full names of every linear module, as in the checkpoint (`model.layers.3.mlp.up_proj`)."""
        names = [f"{self.layer_prefix}.{i}.{lin.name}" for i in range(self.layers) for lin in self.linears()]
        return [*names, "lm_head"]

    @property
    def largest_matrix(self) -> int:
        """Parameters of the largest weight matrix: the embedding, the output projection or a linear layer."""
        return max([self.embedding_params, self.lm_head_params, *(lin.params for lin in self.linears())])

    @property
    def embedding_params(self) -> int:
        return (self.vocab + self.positions) * self.hidden

    @property
    def layer_params(self) -> int:
        if self.layout == "gpt2":  # every projection has a bias; two LayerNorms with weight and bias
            return sum(lin.params + lin.out_features for lin in self.linears()) + 4 * self.hidden
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.attention_bias else 0
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return sum(lin.params for lin in self.linears()) + bias + norms

    @property
    def lm_head_params(self) -> int:
        """Parameters the output projection adds (none when it shares the embedding matrix)."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def param_count(self) -> int:
        final_norm = 2 * self.hidden if self.layout == "gpt2" else self.hidden
        return self.embedding_params + self.layers * self.layer_params + final_norm + self.lm_head_params

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        """Keys and values for one token across all layers: 2 × layers × KV heads × head dim × bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_element


def matches(module: str, patterns: list[str]) -> bool:
    """Whether a module name is selected by a skip list entry.

    An entry matches the module itself or any module whose name ends with `.<entry>`:
    "lm_head" and "mlp.down_proj" select by suffix, "model.layers.0.mlp.down_proj" one module.
    """
    return any(module == p or module.endswith("." + p) for p in patterns)


def quantized_linears(shapes: DecoderShapes, skip: list[str]) -> list[tuple[str, Linear]]:
    """(full name, shape) of every decoder-layer linear not selected by `skip`.

    lm_head is left out: kiln's methods keep the output projection in high precision.
    """
    return [(f"{shapes.layer_prefix}.{i}.{lin.name}", lin) for i in range(shapes.layers) for lin in shapes.linears()
            if not matches(f"{shapes.layer_prefix}.{i}.{lin.name}", skip)]


def group_size_problem(shapes: DecoderShapes, skip: list[str], group_size: int) -> str | None:
    """The first quantized input dimension `group_size` does not divide, as a sentence, or None.

    Groups run along each linear's input dimension, so every quantized in_features must be a
    multiple of the group size (CPU int4 kernels fail otherwise: "expect K to be divisible by
    qGroupSize").
    """
    if group_size <= 0:
        return None
    for _, lin in quantized_linears(shapes, skip):
        if lin.in_features % group_size:
            dims = {q.in_features for _, q in quantized_linears(shapes, skip)}
            fits = [g for g in (1024, 512, 256, 128, 64, 32, 16) if g < group_size and all(d % g == 0 for d in dims)]
            hint = f" Use {' or '.join(str(g) for g in fits[:2])}." if fits else " Use -1 (one group per channel)."
            return (f"{group_size} must divide every quantized layer's input dimension; {lin.in_features} "
                    f"({lin.in_from}) is not divisible by {group_size}.{hint}")
    return None


def checked_shapes(model_config: dict[str, Any], skip: list[str], group_size: int | None = None) -> DecoderShapes:
    """The decoder's shapes, once `skip` (the method's skip_modules) and, for a method that quantizes in
    groups, `group_size` are found to fit them: what a quantizer's `check` refuses up front."""
    shapes = DecoderShapes.from_config(model_config)
    check_skip_modules(shapes, skip)
    if group_size is not None and (problem := group_size_problem(shapes, skip, group_size)):
        raise BadInput(f"optimize.group_size: {problem}")
    return shapes


def check_skip_modules(shapes: DecoderShapes, skip: list[str]) -> None:
    """Refuse skip entries that select no module: a typo would silently quantize what it meant to keep."""
    names = shapes.module_names()
    unknown = [p for p in skip if not any(matches(m, [p]) for m in names)]
    if unknown:
        raise BadInput(f"optimize.skip_modules: {', '.join(repr(p) for p in unknown)} matches no module. Give "
                       "a full name such as 'model.layers.0.mlp.down_proj' or a suffix such as 'mlp.down_proj' "
                       "(every layer's) or 'lm_head'.")
