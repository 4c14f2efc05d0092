"""A model's configuration, ModelConfig, read and checked from an HF `config.json` (the
architectures it may name: architectures.py)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from flexsgl.errors import CheckpointError, short_repr
from flexsgl.model.architectures import ARCHITECTURES, import_target
from flexsgl.model.mla_config import MLAConfig, MoEConfig, deepseek_v2_params
from flexsgl.quant.scheme import SERVED, QuantScheme, quant_scheme


def quant_config(d: dict):
    """A config's quantization_config, or an older llm-compressor export's compression_config (as vLLM
    reads them), or None."""
    q = d.get("quantization_config")
    return d.get("compression_config") if q is None else q


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # A sliding window of this many keys on the layers `layer_types` marks "sliding_attention" (on
    # every layer where it marks none)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # Gemma: tanh caps of the attention scores and of the final logits (None: none), the softmax
    # scale's query_pre_attn_scalar**-0.5, and the RoPE base of the sliding-window layers (Gemma 3)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V2); None: GQA
    moe: MoEConfig | None = None
    # GPT-OSS's experts' clamped SwiGLU: (up + 1) * gate * sigmoid(alpha * gate), gate clamped above at
    # limit, up to [-limit, limit]
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    quant: QuantScheme | None = None  # the checkpoint's quantization_config (flexsgl/quant/scheme.py)
    hf: dict = field(default_factory=dict, compare=False, repr=False)
    # Under tensor parallelism (shard below): this rank, the number of ranks, and the whole model's config.
    tp_rank: int = 0
    tp_size: int = 1
    unsharded: ModelConfig | None = field(default=None, compare=False, repr=False)

    def shard(self, rank: int, size: int) -> "ModelConfig":
        """The config of rank `rank`'s part of the model among `size` ranks: its q heads, its KV heads
        (at least one: replicated when there are fewer than ranks), its slice of the MLP and of each
        expert's; the vocabulary, hidden size, layers and MLA's latent stay whole
        (flexsgl/distributed/layers.py splits them)."""
        if size == 1:
            return self
        moe = None if self.moe is None else dataclasses.replace(self.moe,
                                                                 intermediate_size=self.moe.intermediate_size // size)
        return dataclasses.replace(self, num_heads=self.num_heads // size,
                                   num_kv_heads=max(1, self.num_kv_heads // size),
                                   intermediate_size=self.intermediate_size // size, moe=moe, tp_rank=rank,
                                   tp_size=size, unsharded=self)

    @property
    def qk_norm(self) -> bool:
        return ARCHITECTURES[self.architecture].qk_norm

    @property
    def attention(self) -> str:
        """The attention kind backends are declared for: "gqa" (MHA/GQA) or "mla"."""
        return "gqa" if self.mla is None else "mla"

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """What the KV pool keeps per token and layer: (tensors, heads, dim): K and V of every KV
        head, or one latent vector (MLA)."""
        if self.mla is not None:
            return 1, 1, self.mla.latent_dim
        return 2, self.num_kv_heads, self.head_dim

    @classmethod
    def from_hf(cls, d: dict, source: str = "The model config") -> "ModelConfig":
        """The config of an HF `config.json` dict, checked key by key; `source` names it in errors
        (CheckpointError, a ValueError, that names the file and the key)."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source} must hold a JSON object, got a {type(d).__name__}.")
        get = _Keys(d, source)
        by_type = {a.model_type: name for name, a in ARCHITECTURES.items()}
        archs = get.typed("architectures", list, None)
        arch = archs[0] if archs else by_type.get(get.typed("model_type", str, None), "?")
        if not isinstance(arch, str) or arch not in ARCHITECTURES:
            raise CheckpointError(f"{source}: model architecture {short_repr(arch)} is not supported; flexsgl runs "
                                  f"{', '.join(ARCHITECTURES)}.")
        q = quant_config(d)
        quant = None if q is None else quant_scheme(q, source)
        for key, supported in UNSUPPORTED_SETTINGS.items():
            if key in d and key not in ARCHITECTURES[arch].ignores and d[key] not in supported:
                raise CheckpointError(f"{source} sets {key} to {short_repr(d[key])}, which flexsgl does not run "
                                      f"(it runs {' or '.join(map(repr, supported))}).")
        # transformers 5 writes `rope_parameters`; older checkpoints write rope_theta + rope_scaling,
        # which wins where both are given, as transformers' convert_rope_params_to_dict has it.
        rope = dict(get.typed("rope_scaling", dict, None) or get.typed("rope_parameters", dict, None) or {})
        theta = get.number({**d, **rope}, "rope_theta", 10000.0)
        rope.pop("rope_theta", None)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope = pretraining_length(rope, d)
        rope_types = ARCHITECTURES[arch].rope_types
        if rope_type not in rope_types:
            raise CheckpointError(f"RoPE type {short_repr(rope_type)} is not supported for {arch}; flexsgl runs "
                                  f"{' and '.join(map(repr, rope_types))}.")
        if rope_type == "llama3":
            for key in LLAMA3_ROPE_KEYS:
                get.number(rope, key)
            if rope["low_freq_factor"] == rope["high_freq_factor"]:
                raise CheckpointError(f"{source}: the llama3 RoPE low_freq_factor and high_freq_factor must differ.")
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
            raise CheckpointError(f"{source}: 'eos_token_id' must be a token id or a list of them, "
                                  f"got {short_repr(d.get('eos_token_id'))}.")
        hidden, heads = get.positive("hidden_size"), get.positive("num_attention_heads")
        kv_heads = get.positive("num_key_value_heads", heads)
        if heads % kv_heads:
            raise CheckpointError(f"{source}: 'num_attention_heads' ({heads}) must be a multiple of "
                                  f"'num_key_value_heads' ({kv_heads}).")
        if d.get("head_dim") is None and hidden % heads:
            raise CheckpointError(f"{source} has no 'head_dim', and 'hidden_size' ({hidden}) is not a multiple of "
                                  f"'num_attention_heads' ({heads}).")
        head_dim = get.positive("head_dim", hidden // heads)
        if head_dim % 2:
            raise CheckpointError(f"{source}: 'head_dim' must be even for rotary embeddings, got {head_dim}.")
        dtype = d.get("torch_dtype") or d.get("dtype")
        extra = ARCHITECTURES[arch].extra_fields
        fields = {} if extra is None else import_target(extra)(get, d, rope, source)
        fields.setdefault("rope_scaling", rope if rope_type != "default" else None)
        fields.setdefault("head_dim", head_dim)
        if ARCHITECTURES[arch].sliding:
            fields.update(_windows(get, d, get.positive("num_hidden_layers"), source))
        return cls(
            architecture=arch,
            vocab_size=get.positive("vocab_size"),
            hidden_size=hidden,
            intermediate_size=get.positive("intermediate_size"),
            num_layers=get.positive("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            rms_norm_eps=get.number(d, "rms_norm_eps", 1e-6),
            rope_theta=fields.pop("rope_theta", theta),
            max_position=get.positive("max_position_embeddings", 4096),
            tie_word_embeddings=fields.pop("tie_word_embeddings", get.typed("tie_word_embeddings", bool, False)),
            attention_bias=fields.pop("attention_bias", get.typed("attention_bias", bool, False)),
            eos_token_ids=eos,
            torch_dtype=dtype if isinstance(dtype, str) else None,
            quant=quant,
            hf=d,
            **fields,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        file = Path(path) / "config.json"
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as e:
            raise CheckpointError(f"Could not read {str(file)!r}: {e.strerror or e}.") from None
        except UnicodeDecodeError:
            raise CheckpointError(f"{str(file)!r} is not UTF-8 text.") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"Config file {str(file)!r} is not valid JSON: {e.msg} at line {e.lineno} column "
                                  f"{e.colno}.") from None
        gptq = Path(path) / "quantize_config.json"
        if isinstance(d, dict) and quant_config(d) is None and gptq.is_file():
            raise CheckpointError(f"{str(gptq)!r} makes this a GPTQ-quantized checkpoint (AutoGPTQ's), which flexsgl "
                                  f"does not serve; it serves {SERVED} checkpoints.")
        return cls.from_hf(d, f"Config file {str(file)!r}")

    def attention_variants(self) -> list:
        """Each layer's own attention variant (flexsgl/attention/variant.py; None: plain causal)."""
        target = ARCHITECTURES[self.architecture].variants
        return window_variants(self) if target is None else import_target(target)(self)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        tensors, heads, dim = self.kv_layout
        return tensors * self.num_layers * heads * dim * itemsize

    def num_params(self) -> int:
        if self.mla is not None:
            return deepseek_v2_params(self)
        count = ARCHITECTURES[self.architecture].params
        if count is not None:
            return import_target(count)(self)
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 2 * h + (2 * d if self.qk_norm else 0)
        moe = self.moe
        sparse = 0 if moe is None else sum(map(moe.sparse, range(self.num_layers)))
        experts = 0 if moe is None else (3 * h * moe.intermediate_size * (moe.n_routed_experts + moe.n_shared_experts)
                                         + moe.n_routed_experts * h)  # and the router
        mlps = (self.num_layers - sparse) * 3 * h * i + sparse * experts
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * layer + mlps + self.vocab_size * h + head + h


def window_variants(cfg: ModelConfig) -> list:
    """A sliding window on the layers cfg.layer_types marks "sliding_attention", or on every layer where
    it has no layer_types; one variant object for all of them."""
    from flexsgl.attention.variants import sliding_window

    if cfg.sliding_window is None:
        return [None] * cfg.num_layers
    window = sliding_window(cfg.sliding_window)
    types = cfg.layer_types or ("sliding_attention",) * cfg.num_layers
    return [window if t == "sliding_attention" else None for t in types]


LAYER_TYPES = ("sliding_attention", "full_attention")


def pretraining_length(rope: dict, d: dict) -> dict:
    """`rope` (a llama3, yarn or longrope RoPE dict; others as they are) with the context length the
    model was trained at as transformers' standardize_rope_params gives it: config.json's top-level
    `original_max_position_embeddings` where it has one (Phi-3's exports write it there), else the
    dict's own, else `max_position_embeddings`."""
    if rope.get("rope_type", rope.get("type")) not in ("llama3", "yarn", "longrope"):
        return rope
    top = d.get("original_max_position_embeddings")
    if top is not None:
        return {**rope, "original_max_position_embeddings": top}
    if "original_max_position_embeddings" not in rope and d.get("max_position_embeddings") is not None:
        return {**rope, "original_max_position_embeddings": d["max_position_embeddings"]}
    return rope


# The window of a windowed architecture whose config.json leaves `sliding_window` out (MistralConfig's)
DEFAULT_WINDOW = 4096


def _windows(get, d: dict, num_layers: int, source: str) -> dict:
    """`sliding_window` and `layer_types` of an architecture with windowed layers (`sliding_window`
    left out: DEFAULT_WINDOW, as transformers; null: none)."""
    window = get.positive("sliding_window", None) if "sliding_window" in d else DEFAULT_WINDOW
    types = get.typed("layer_types", list, None)
    if types is not None and (len(types) != num_layers or not all(t in LAYER_TYPES for t in types)):
        raise CheckpointError(f"{source}: 'layer_types' must name {' or '.join(LAYER_TYPES)} for each of the "
                              f"{num_layers} layers.")
    return {"sliding_window": window, "layer_types": None if types is None else tuple(types)}


# config.json settings flexsgl's decoder does not implement, and the values it does.
UNSUPPORTED_SETTINGS = {"hidden_act": ("silu",), "mlp_bias": (False,), "use_sliding_window": (False,),
                        "moe_layer_freq": (1,)}
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_MISSING = object()


class _Keys:
    """Reads keys of a config dict, checking their types; errors name the config and the key."""

    def __init__(self, d: dict, source: str):
        self.d, self.source = d, source

    def _fail(self, key: str, what: str, value) -> CheckpointError:
        return CheckpointError(f"{self.source}: {key!r} must be {what}, got {short_repr(value)}.")

    def typed(self, key: str, kind: type, default):
        value = self.d.get(key)
        if value is None:
            return default
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise self._fail(key, f"a JSON {_JSON_NAMES[kind]}", value)
        return value

    def positive(self, key: str, default=_MISSING) -> int:
        value = self.d.get(key)
        if value is None:
            if default is _MISSING:
                raise CheckpointError(f"{self.source} lacks {key!r}, which the model needs.")
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self._fail(key, "a positive integer", value)
        return value

    def number(self, d: dict, key: str, default=_MISSING) -> float:
        value = d.get(key)
        if value is None:
            if default is _MISSING:
                raise CheckpointError(f"{self.source} lacks {key!r}, which the model needs.")
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
            raise self._fail(key, "a positive number", value)
        return float(value)


_JSON_NAMES = {list: "list", dict: "object", str: "string", bool: "true or false"}
