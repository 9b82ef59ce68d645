"""The embedded engine's model side: an HF causal LM, one batched KV cache with per-row lengths, and sampling.

KV-cache layout and why
-----------------------
All running requests share one `transformers.DynamicCache` whose tensors are [rows, kv_heads, L, head_dim].
Rows have different lengths, so each row's real tokens are *right-aligned* in the L columns and the columns to
their left are padding, hidden by a 2-D attention mask; `position_ids` carry each row's true position, so
rotary embeddings see the same positions as an unpadded run.

This layout was chosen over per-request caches stacked each step because a decode step then costs one forward
pass over tensors that are already batched: joins and leaves, which are rarer than steps, pay the copies
(`retain` gathers the surviving rows, `_merge` left-pads the shorter of two caches), while a step only appends
one column. It also works with any HF decoder-only model that takes `attention_mask`, `position_ids` and
`past_key_values` (Llama, Qwen2, SmolLM2, ...), so no model code is rewritten. The price is memory: every row is
as long as the longest one (bounded by the engine's context length); leading columns that no row uses any more
are trimmed whenever rows leave.

Models with sliding-window layers are rejected: the mask would count padding columns as positions.

LoRA: with `lora_layers` (an engine started with `--enable-lora`), `prefill` and `decode` take one adapter per row
(None: the base model) and run the pass with those rows' adapters added (`lora.LoRALayers`); the KV cache of a row
is then its adapter's, and a row keeps its adapter until it leaves.

Threading: the scheduler runs `prefill`/`decode` in one worker thread at a time and calls the other methods
between steps, so this class holds no lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel

from rllm.experimental.fully_async.engines.embedded.lora import LoRAAdapter, LoRALayers
from rllm.experimental.fully_async.engines.embedded.sampling import SEEDED_RULES, SampleOutput, SamplingParams, sample

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelInfo:
    """What the scheduler needs to know about the loaded model."""

    model_path: str
    model_type: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    context_length: int
    num_parameters: int
    fingerprint: str  # `describe_folder` of the folder it came from: equal fingerprints, same computation


# config.json keys that differ between two saves of the same model: they do not change what the model computes.
VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype"})


def describe_folder(model_path: str | Path) -> str:
    """What an HF folder says about its model (config.json, generation_config.json minus volatile keys), as JSON."""
    description = {}
    for name in ("config.json", "generation_config.json"):
        path = Path(model_path) / name
        if path.exists():
            config = json.loads(path.read_text())
            description[name] = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    return json.dumps(description, sort_keys=True)


def _as_id_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def load_model(model_path: str | Path, dtype: str = "float32") -> tuple[PreTrainedModel, ModelInfo]:
    """Load an HF causal-LM folder (safetensors) for inference and describe it.

    Raises ValueError for a dtype or an architecture the engine cannot serve (sliding-window attention).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    config = AutoConfig.from_pretrained(model_path)
    text_config = config.get_text_config(decoder=True)
    layer_types = getattr(text_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"{model_path}: layer types {sorted(set(layer_types))} are not supported; the embedded engine's "
            "left-padded batched cache needs full attention in every layer"
        )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype], attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    eos = _as_id_set(getattr(text_config, "eos_token_id", None))
    if model.generation_config is not None:
        eos |= _as_id_set(model.generation_config.eos_token_id)
    info = ModelInfo(
        model_path=str(model_path),
        model_type=str(text_config.model_type),
        vocab_size=int(text_config.vocab_size),
        eos_token_ids=frozenset(eos),
        context_length=int(getattr(text_config, "max_position_embeddings", 0) or 1 << 30),
        num_parameters=sum(p.numel() for p in model.parameters()),
        fingerprint=describe_folder(model_path),
    )
    return model, info


class ModelRunner:
    """Owns the model, the batched KV cache of the running rows and the seeded sampler.

    Row order is the scheduler's: `prefill` appends rows at the end, `decode` takes one input token per row in
    row order, `retain` keeps a subset in the given order.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        info: ModelInfo,
        *,
        seed: int = 0,
        seeded_rule: str = "exact",
        lora_layers: LoRALayers | None = None,
    ) -> None:
        self.model = model
        self.info = info
        self.lora_layers = lora_layers
        if lora_layers is not None:
            lora_layers.attach(model)
        self.generator = torch.Generator().manual_seed(seed)
        if seeded_rule not in SEEDED_RULES:
            raise ValueError(f"seeded_rule must be one of {SEEDED_RULES}, got {seeded_rule!r}")
        self.seeded_rule = seeded_rule  # how a request with a sampling_seed draws (sampling.py; the stand-in: SGLang's)
        self.forward_passes = 0
        self.prefill_passes = 0
        self._cache: DynamicCache | None = None
        self._lengths: list[int] = []  # real (unpadded) tokens held in the cache, per row

    @property
    def num_rows(self) -> int:
        return len(self._lengths)

    @property
    def cache_columns(self) -> int:
        return self._cache.get_seq_length() if self._cache is not None else 0

    def swap_model(self, model: PreTrainedModel, info: ModelInfo) -> None:
        """Replace the weights (between steps). The cache was computed by the old weights, so it must be empty."""
        if self.num_rows:
            raise RuntimeError(f"cannot swap weights with {self.num_rows} rows in the KV cache")
        self.model, self.info = model, info
        if self.lora_layers is not None:
            self.lora_layers.attach(model)
        self._cache = None

    def clear(self) -> None:
        """Drop every row and the cache (flush)."""
        self._cache = None
        self._lengths = []

    def _adapters(self, adapters: list[LoRAAdapter | None] | None) -> contextlib.AbstractContextManager[None]:
        """The context a pass runs in: the rows' adapters added, or nothing when no row uses one."""
        if adapters is None or not any(adapters):
            return contextlib.nullcontext()
        if self.lora_layers is None:
            raise RuntimeError("rows name LoRA adapters, but the runner was built without lora_layers")
        return self.lora_layers.rows(adapters)

    @torch.inference_mode()
    def prefill(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        adapters: list[LoRAAdapter | None] | None = None,
    ) -> SampleOutput:
        """Run the prompts as one left-padded batch, sample each one's first token, append them as new rows.
        `adapters`: each prompt's LoRA adapter (None: the base model)."""
        width = max(len(p) for p in prompts)
        input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()
        with self._adapters(adapters):
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        self.forward_passes += 1
        self.prefill_passes += 1
        self._merge(cache, [len(p) for p in prompts])
        # a seeded row's draw is keyed by the position of the token it fed: here each prompt's last
        positions = [len(p) - 1 for p in prompts]
        return sample(out.logits[:, -1, :], params, self.generator, positions, self.seeded_rule)

    @torch.inference_mode()
    def decode(
        self, last_tokens: list[int], params: list[SamplingParams], adapters: list[LoRAAdapter | None] | None = None
    ) -> SampleOutput:
        """One decode step for every row: feed each row's last sampled token, sample the next one. `adapters`: each
        row's LoRA adapter (None: the base model), the one it was prefilled with."""
        if len(last_tokens) != self.num_rows:
            raise RuntimeError(f"decode got {len(last_tokens)} tokens for {self.num_rows} rows")
        columns = self.cache_columns
        lengths = torch.tensor(self._lengths, dtype=torch.long)
        # Column j of row b is real iff it is among the row's last `length` columns; the new column is real.
        mask = torch.ones((self.num_rows, columns + 1), dtype=torch.long)
        mask[:, :columns] = (torch.arange(columns).unsqueeze(0) >= (columns - lengths).unsqueeze(1)).long()
        with self._adapters(adapters):
            out = self.model(
                input_ids=torch.tensor(last_tokens, dtype=torch.long).unsqueeze(1),
                attention_mask=mask,
                position_ids=lengths.unsqueeze(1),
                past_key_values=self._cache,
                use_cache=True,
            )
        self.forward_passes += 1
        fed_at = list(self._lengths)  # the position of each row's fed token (its position_ids above)
        self._lengths = [n + 1 for n in self._lengths]
        return sample(out.logits[:, -1, :], params, self.generator, fed_at, self.seeded_rule)

    def retain(self, keep: list[int]) -> None:
        """Keep only rows `keep` (in that order) and trim padding columns no remaining row uses."""
        if keep == list(range(self.num_rows)):
            return
        self._lengths = [self._lengths[i] for i in keep]
        if not keep or self._cache is None:
            self.clear()
            return
        index = torch.tensor(keep, dtype=torch.long)
        lead = self.cache_columns - max(self._lengths)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, lead:, :]
            layer.values = layer.values.index_select(0, index)[:, :, lead:, :]

    def _merge(self, new: DynamicCache, new_lengths: list[int]) -> None:
        """Append the rows of `new` below the running rows, left-padding whichever cache is shorter."""
        if self._cache is None or not self._lengths:
            self._cache, self._lengths = new, list(new_lengths)
            return
        old_cols, new_cols = self.cache_columns, new.get_seq_length()
        width = max(old_cols, new_cols)
        for old_layer, new_layer in zip(self._cache.layers, new.layers, strict=True):
            old_layer.keys = torch.cat([_left_pad(old_layer.keys, width), _left_pad(new_layer.keys, width)])
            old_layer.values = torch.cat([_left_pad(old_layer.values, width), _left_pad(new_layer.values, width)])
        self._lengths.extend(new_lengths)


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad [rows, heads, cols, dim] on the left of the column axis to `width` columns (masked later)."""
    missing = width - t.shape[2]
    if missing == 0:
        return t
    return torch.nn.functional.pad(t, (0, 0, missing, 0))
