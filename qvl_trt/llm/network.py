"""The Qwen3-VL causal LM as a TensorRT-LLM 1.2 network (engine path), built from
TensorRT-LLM's own layers so the stock C++ runtime and the tensorrtllm Triton backend run the
engine unchanged: no engine input beyond the ones they feed (input_ids, the prompt table,
tasks, prompt_vocab_size, mrope_rotary_cos_sin, mrope_position_deltas).

- Decoder: Qwen3 dense layers (RMSNorm, GQA with per-head q/k RMSNorm before RoPE, SwiGLU),
  position_embedding_type mrope. The attention plugin rotates the prompt with the request's
  host-built `mrope_rotary_cos_sin` table and generated tokens with plain RoPE at cache
  length + mrope_position_delta (all three axes agree there). Nothing in the engine reads
  mrope_section: Attention takes only the type and factor of rotary_scaling, and the plugin's
  RoPE constants for type mrope are plain ones. Qwen3-VL's interleaved T/H/W layout lives in
  the host table (qvl_trt.mm.rope); only TensorRT-LLM's own host code for Qwen2-VL
  (MultimodalModelRunner) hard-codes the contiguous [16, 24, 24] split, and we do not use it.
- DeepStack: each visual token owns 1+K consecutive prompt-table rows (main embedding, then
  DeepStack feature k) and carries the fake id vocab_size + (1+K)i. The embedding returns
  the main row as the layer-0 input and, for k < K, row i+1+k (selected to zero on text
  tokens with `where`, never multiplied by a mask: the runtime's table buffer is not
  zeroed), which is added to the hidden state after decoder layer k.
- Precision: float16 or bfloat16 only. The attention plugin reads `mrope_rotary_cos_sin`
  only on its fused (FMHA) context path, which exists for fp16/bf16 alone (attentionOp.cpp:
  "Fall back to unfused MHA because of unsupported data type"); the unfused path rotates
  image tokens at their 1-D index. qvl_trt.llm.engine refuses float32 and context_fmha off.

Only imported where tensorrt_llm is present (the engine build's child process, the trtllm
tests). Importing it registers the class in tensorrt_llm.models.MODEL_MAP, which
TensorRT-LLM's Python loaders (PretrainedConfig.from_dict, EngineConfig, ModelRunnerCpp)
look the checkpoint's architecture name up in.
"""

from __future__ import annotations

from tensorrt_llm._utils import pad_vocab_size
from tensorrt_llm.functional import LayerNormType, Tensor, cast, embedding, unsqueeze, where
from tensorrt_llm.layers import Attention, AttentionMaskType, ColumnLinear, GatedMLP, RmsNorm
from tensorrt_llm.models import MODEL_MAP
from tensorrt_llm.models.modeling_utils import (
    DecoderLayerList,
    DecoderModelForCausalLM,
    PretrainedConfig,
)
from tensorrt_llm.module import Module
from tensorrt_llm.parameter import Parameter

from .layout import ARCHITECTURE


class Qwen3VLConfig(PretrainedConfig):
    """PretrainedConfig plus the keys `qvl-trt convert` writes beside TensorRT-LLM's own."""

    def __init__(self, *, num_deepstack_layers: int, rotary_base: float,
                 rotary_scaling: dict | None = None, qwen_type: str = "qwen3",
                 attn_bias: bool = False, mlp_bias: bool = False,
                 tie_word_embeddings: bool = False, **kwargs) -> None:
        self.num_deepstack_layers = num_deepstack_layers
        self.rotary_base = rotary_base
        # {"type": "mrope", "mrope_section": [...], "mrope_interleaved": true}, the shape of
        # Qwen2-VL's rope_scaling: Attention and the builder read only its type (and factor).
        self.rotary_scaling = rotary_scaling
        self.qwen_type = qwen_type
        self.attn_bias = attn_bias
        self.mlp_bias = mlp_bias
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(**kwargs)


class DeepStackEmbedding(Module):
    """Token embedding with the prompt-table lookup of PromptTuningEmbedding, plus the K
    DeepStack rows of each visual token.

    Deliberately not an `Embedding`: TensorRT-LLM's optimize_model (set_prompt_tuning) swaps
    every Embedding named `vocab_embedding` for a PromptTuningEmbedding when the engine has a
    prompt table, which would drop the DeepStack lookups. The weight keeps the checkpoint name
    `transformer.vocab_embedding.weight`, so share_embedding still ties it to lm_head.
    """

    def __init__(self, vocab_size: int, hidden_size: int, deepstack_layers: int,
                 dtype: str) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.deepstack_layers = deepstack_layers
        self.weight = Parameter(shape=(vocab_size, hidden_size), dtype=dtype)

    def forward(self, input_ids: Tensor, prompt_embedding_table: Tensor | None = None,
                tasks: Tensor | None = None,
                task_vocab_size: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
        """The layer-0 hidden states and the K DeepStack residuals ([] without a table)."""
        if prompt_embedding_table is None:
            return embedding(input_ids, self.weight.value), []
        visual = input_ids > (self.vocab_size - 1)
        text = embedding(where(visual, self.vocab_size - 1, input_ids), self.weight.value)
        offset = input_ids - self.vocab_size
        # Each request's rows start at its task's block of the batch's concatenated tables.
        block = tasks * task_vocab_size
        keep = unsqueeze(visual, -1)

        def rows(shift: int) -> Tensor:
            # Text tokens read the block's first row, which always exists; `where` drops it.
            index = where(visual, offset + shift, 0) + block
            return embedding(index, prompt_embedding_table)

        hidden = where(keep, rows(0), text)
        # The runtime never zeroes its table buffer, so the row a text token reads may hold
        # stale NaN/Inf bits and a 0/1 mask product would keep them (NaN x 0 = NaN): select.
        # The zero is made in the table's dtype as functional.embedding's TP path does
        # (cast mask minus itself): where() turns a Python 0.0 into a float32 constant
        # (constants_to_tensors_), which a strongly typed fp16/bf16 select refuses.
        mask = cast(keep, hidden.dtype)
        zero = mask - mask
        return hidden, [where(keep, rows(1 + k), zero) for k in range(self.deepstack_layers)]


class Qwen3VLDecoderLayer(Module):
    """One Qwen3 decoder layer; `deepstack_residual`, when set, is added to its output."""

    def __init__(self, config: Qwen3VLConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        dtype, mapping = config.dtype, config.mapping
        self.input_layernorm = RmsNorm(normalized_shape=config.hidden_size,
                                       eps=config.norm_epsilon, dtype=dtype)
        self.attention = Attention(
            local_layer_idx=layer_idx,
            hidden_size=config.hidden_size,
            attention_head_size=config.head_size,
            num_attention_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings,
            dtype=dtype,
            attention_mask_type=AttentionMaskType.causal,
            bias=config.attn_bias,
            dense_bias=False,
            position_embedding_type=config.position_embedding_type,
            rotary_embedding_base=config.rotary_base,
            rotary_embedding_scaling=config.rotary_scaling,
            tp_group=mapping.tp_group,
            tp_size=mapping.tp_size,
            tp_rank=mapping.tp_rank,
            quant_mode=config.quant_mode,
            qk_layernorm=True,
            layernorm_type=LayerNormType.RmsNorm,
            # Qwen3's q_norm/k_norm use rms_norm_eps; Attention defaults to 1e-5.
            eps=config.norm_epsilon,
        )
        self.post_layernorm = RmsNorm(normalized_shape=config.hidden_size,
                                      eps=config.norm_epsilon, dtype=dtype)
        self.mlp = GatedMLP(hidden_size=config.hidden_size,
                            ffn_hidden_size=config.intermediate_size,
                            hidden_act=config.hidden_act, bias=config.mlp_bias, dtype=dtype,
                            tp_group=mapping.tp_group, tp_size=mapping.tp_size,
                            quant_mode=config.quant_mode)
        self.deepstack_residual: Tensor | None = None

    def forward(self, hidden_states: Tensor, attention_mask=None, use_cache=False,
                spec_decoding_params=None, kv_cache_params=None, attention_params=None,
                lora_layer_params=None, mrope_params=None):
        residual = hidden_states
        attention_output = self.attention(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            use_cache=use_cache,
            spec_decoding_params=spec_decoding_params,
            kv_cache_params=kv_cache_params,
            attention_params=attention_params,
            lora_layer_params=lora_layer_params,
            mrope_params=mrope_params,
        )
        if use_cache:
            attention_output, presents = attention_output
        hidden_states = residual + attention_output
        hidden_states = hidden_states + self.mlp(self.post_layernorm(hidden_states),
                                                 lora_layer_params=lora_layer_params)
        if self.deepstack_residual is not None:
            hidden_states = hidden_states + self.deepstack_residual
        if use_cache:
            return hidden_states, presents
        return hidden_states


class Qwen3VLModel(Module):
    """Embedding (with DeepStack rows), decoder layers, final norm."""

    def __init__(self, config: Qwen3VLConfig) -> None:
        super().__init__()
        self.vocab_embedding = DeepStackEmbedding(config.vocab_size, config.hidden_size,
                                                  config.num_deepstack_layers, config.dtype)
        self.layers = DecoderLayerList(Qwen3VLDecoderLayer, config)
        self.ln_f = RmsNorm(normalized_shape=config.hidden_size, eps=config.norm_epsilon,
                            dtype=config.dtype)

    def forward(self, input_ids: Tensor, position_ids=None, use_cache=False,
                attention_mask=None, kv_cache_params=None, attention_params=None,
                mrope_params=None, hidden_states=None,
                prompt_embedding_table: Tensor | None = None,
                prompt_tasks: Tensor | None = None, prompt_vocab_size: Tensor | None = None,
                lora_params=None, spec_decoding_params=None):
        hidden_states, deepstack = self.vocab_embedding(input_ids, prompt_embedding_table,
                                                        prompt_tasks, prompt_vocab_size)
        # DecoderLayerList.forward owns the per-layer KV-cache plumbing; rather than copy
        # that loop, hand layer k its DeepStack residual for the duration of this trace.
        for layer, residual in zip(self.layers, deepstack, strict=False):
            layer.deepstack_residual = residual
        try:
            hidden_states = self.layers.forward(
                hidden_states,
                use_cache=use_cache,
                attention_mask=attention_mask,
                kv_cache_params=kv_cache_params,
                attention_params=attention_params,
                mrope_params=mrope_params,
                lora_params=lora_params,
                spec_decoding_params=spec_decoding_params,
            )
        finally:
            for layer in self.layers:
                layer.deepstack_residual = None
        if use_cache:
            hidden_states, presents = hidden_states
            return self.ln_f(hidden_states), tuple(presents)
        return self.ln_f(hidden_states)


class Qwen3VLForCausalLM(DecoderModelForCausalLM):
    """The engine's top module; load it with `from_checkpoint(dir, rank=r)`."""

    config_class = Qwen3VLConfig

    def __init__(self, config: Qwen3VLConfig) -> None:
        mapping = config.mapping
        if mapping.pp_size != 1 or mapping.cp_size != 1:
            raise ValueError("Qwen3VLForCausalLM supports tensor parallelism only "
                             f"(pp_size {mapping.pp_size}, cp_size {mapping.cp_size})")
        if config.num_attention_heads == config.num_key_value_heads:
            # Attention's q/k-norm path reads a fused qkv as [heads, 3, head_size] when the
            # head counts are equal, not the [q; k; v] rows `convert` writes.
            raise ValueError("Qwen3VLForCausalLM needs grouped-query attention "
                             "(num_key_value_heads < num_attention_heads)")
        if config.num_deepstack_layers > config.num_hidden_layers:
            raise ValueError(f"{config.num_deepstack_layers} DeepStack residuals need as many "
                             f"decoder layers, the model has {config.num_hidden_layers}")
        lm_head = ColumnLinear(config.hidden_size,
                               pad_vocab_size(config.vocab_size, mapping.tp_size),
                               bias=False, dtype=config.dtype, tp_group=mapping.tp_group,
                               tp_size=mapping.tp_size, gather_output=True)
        super().__init__(config, Qwen3VLModel(config), lm_head)

    def prepare_inputs(self, *args, **kwargs):
        """The builder's inputs plus `mrope_rotary_cos_sin` / `mrope_position_deltas`:
        tensorrt_llm.builder.build passes their size only for Qwen2-VL architecture names,
        and the attention plugin requires them once position_embedding_type is mrope."""
        kwargs["mrope_rotary_cos_sin_size"] = (self.config.max_position_embeddings
                                               * self.config.rotary_embedding_dim)
        return super().prepare_inputs(*args, **kwargs)


MODEL_MAP.setdefault(ARCHITECTURE, Qwen3VLForCausalLM)
