"""A pretrained Hugging Face model: ``--model hf:PATH``.

``PATH`` is a folder as ``save_pretrained`` writes it (``config.json``, and one or several
``*.safetensors`` with their index), or a hub id already in the local Hugging Face cache (found
offline: nothing is downloaded). The model is built on the meta device from its config
(:func:`build_from_config`, usable without any weights), parallelised as any other model, then
its weights are read straight into the sharded parameters (:mod:`fsdp2lab.models.hf_weights`).
A folder without safetensors files is trained from scratch with the seeded init.

Dense causal language models whose checkpoint keys map one to one onto their modules (Llama,
Mistral, Qwen2/3, Gemma and the like) are supported; a model that needs remote code or
transformers' key conversion (fused MoE experts) is refused with one line. ``--pp`` splits Llama,
Mistral and Qwen2/3 (:func:`pipeline`, :func:`pipeline_stage`) and refuses the others.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn as nn

from fsdp2lab.errors import UsageError
from fsdp2lab.models.spec import ModelSpec, infer_units

PREFIX = "hf:"


def is_hf(name: str) -> bool:
    return name.startswith(PREFIX)


def locate(reference: str) -> Path:
    """The local folder of ``hf:PATH``: PATH itself, or a hub id's snapshot in the local cache."""
    where = reference.removeprefix(PREFIX)
    path = Path(where).expanduser()
    if not path.is_dir() and where.count("/") == 1 and not where.startswith((".", "/")):
        path = _cached_snapshot(where) or path
    if not path.is_dir():
        raise UsageError(
            f"--model hf:{where}: no such folder, nor a hub model in the local Hugging Face "
            "cache (download it first: `hf download ID` on a machine with internet)"
        )
    if not (path / "config.json").is_file():
        raise UsageError(
            f"--model hf:{where}: {path} has no config.json (expected a folder as "
            "save_pretrained writes it)"
        )
    return path.resolve()


def _cached_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not in the cache (or no huggingface_hub): not a hub model here
        return None


def read_config(folder: Path):
    """The model's transformers config, read offline; a malformed config.json, remote code, a
    hub kernel, sizes that are not positive integers and unknown types refused."""
    file = folder / "config.json"
    try:
        raw = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--model hf:{folder}: {file} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise UsageError(f"--model hf:{folder}: {file} is not a JSON object")
    check_settings(raw, f"--model hf:{folder}", "config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError) as e:
        raise UsageError(
            f"--model hf:{folder}: model type {raw.get('model_type')!r} is not known to "
            f"transformers here ({first_line(e)})"
        ) from None
    except Exception as e:  # the config's own checks (a field of the wrong type, a division)
        raise UsageError(
            f"--model hf:{folder}: config.json is refused by transformers: {first_line(e)}"
        ) from None


# Sizes a causal LM's config gives, each a positive integer where it is set.
POSITIVE_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
# Keys that ask transformers to import the model's own code.
REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code")
ATTENTION_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal")


def check_settings(settings: dict, where: str, what: str) -> None:
    """A UsageError (``where: ...``) naming the key where a Hugging Face config ``what``
    (``config.json``, a checkpoint's recorded ``hf_config``; sub-configs too) asks for code
    (``auto_map``, ``trust_remote_code``), for an attention that is not one of transformers' own
    (a hub kernel, ``org/repo``), or gives one of :data:`POSITIVE_SIZES` as anything but a
    positive integer."""
    for key, value in settings.items():
        if key in REMOTE_CODE_KEYS and value:
            raise UsageError(
                f"{where}: the model needs remote code ({key} in {what}), which fsdp2lab does "
                "not run"
            )
        if key in ATTENTION_KEYS and value is not None:
            for name in value.values() if isinstance(value, dict) else [value]:
                if name is not None and not (isinstance(name, str) and name in builtin_attention()):
                    raise UsageError(
                        f"{where}: {key} {name!r} in {what} is not one of transformers' own "
                        f"attentions ({', '.join(sorted(builtin_attention()))}): no kernel is "
                        "fetched from the hub"
                    )
        if key in POSITIVE_SIZES and value is not None and not _positive_int(value):
            raise UsageError(f"{where}: {key} is {value!r} in {what}, not a positive integer")
        if isinstance(value, dict):  # a sub-config (text_config, ...)
            check_settings(value, where, what)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@functools.cache
def builtin_attention() -> frozenset[str]:
    """transformers' own attention implementations (no hub kernel): eager, sdpa, flash and flex
    attention, and their ``paged|`` forms."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    names = {"eager", *ALL_ATTENTION_FUNCTIONS.keys()}
    names = {n for n in names if "/" not in n and ":" not in n}
    return frozenset(names | {f"paged|{n}" for n in names if not n.startswith("paged|")})


def first_line(e: BaseException) -> str:
    """An exception's first line (its type when it has no message)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def build_from_config(config, attn_implementation: str | None = None) -> nn.Module:
    """The causal LM of ``config`` in fp32 (call it under ``torch.device("meta")``, or through
    :func:`~fsdp2lab.models.materialize.build_on_meta`, to build it without memory); its config
    keeps the ``dtype`` config.json names (what ``--save-hf`` and ``ckpt export`` write)."""
    from transformers import AutoModelForCausalLM

    attn = attn_implementation or getattr(config, "_attn_implementation", None) or "sdpa"
    where = f"--model hf:{getattr(config, 'name_or_path', '')}"
    source_dtype = getattr(config, "dtype", None)  # config.json's: the dtype a save keeps
    try:
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn, trust_remote_code=False
        )
    except ValueError as e:
        raise UsageError(
            f"{where}: {type(config).__name__} has no causal language model in transformers: "
            f"{first_line(e)}"
        ) from None
    except UsageError:
        raise
    except Exception as e:  # a config transformers took that its model cannot be built from
        raise UsageError(
            f"{where}: no model from its config.json ({type(e).__name__}: {first_line(e)})"
        ) from None
    model.config.dtype = source_dtype  # from_config set it to fp32
    return model


def without_kv_cache(model: nn.Module) -> nn.Module:
    """``model`` called with ``use_cache=False``, its config left as it is (the export's
    ``config.json`` keeps the folder's ``use_cache``). transformers' causal LMs default to a
    key/value cache, which in training holds every layer's keys and values for the whole step,
    and again (concatenated) for each layer activation checkpointing recomputes."""
    model.forward = functools.partial(model.forward, use_cache=False)
    return model


@contextlib.contextmanager
def masks_decided_as_for_real_tensors():
    """transformers leaves the causal mask to SDPA's ``is_causal`` (the flash kernel) when the
    position ids show one sequence per row, which it reads from their values; a fake tensor has
    none, so under the plan's fake tensors a model would build the (batch, 1, seq, seq) mask and
    take the attention path that a real run skips. The trainer's rows are single windows
    (positions 0 to seq - 1): for the duration, transformers finds no packed sequences, as it
    does in the real run."""
    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    real = getattr(masking_utils, "find_packed_sequence_indices", None)
    if real is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = real


def spec(reference: str, cfg) -> ModelSpec:
    """The spec of ``hf:PATH``: built from its config, sharded per decoder layer, and (where the
    folder holds weights) loaded from its safetensors files instead of initialised."""
    from fsdp2lab.models import hf_weights

    folder = locate(reference)
    index = hf_weights.WeightIndex.read(folder)
    config = read_config(folder)
    limit = getattr(config, "max_position_embeddings", None)

    def build(c) -> nn.Module:
        if limit is not None and c.seq_len > limit:
            raise UsageError(
                f"--seq-len {c.seq_len} is above the model's max_position_embeddings {limit}"
            )
        model = build_from_config(config)
        if index is not None:
            index.check(model, reference)
        return without_kv_cache(model)

    return ModelSpec(
        name=reference,
        build=build,
        task="lm",
        input_shape=None,
        datasets=("synthetic", "text", "tokens"),
        default_dataset="synthetic",
        units=infer_units,
        head=head,
        tp_plan=tp_plan_of(config),
        tp_plan_name=tp_plan_name(config),
        tp_sizes=tp_sizes,
        pipeline=pipeline,
        pipeline_stage=pipeline_stage,
        real_buffers=True,
        fixed={"vocab_size": config.vocab_size},
        load_weights=None if index is None else index.load,
        source=str(folder),
    )


def head(model: nn.Module) -> list[str]:
    """The base model's final ``norm`` (where it has one) and the output projection; none where the
    projection is tied to the embedding (one parameter: it stays with the embedding, in the root)."""
    out, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or (embedding is not None and out.weight is embedding.weight):
        return []
    names = {module: name for name, module in model.named_modules()}
    return [names[m] for m in (getattr(model.base_model, "norm", None), out) if m is not None]


# ---------------------------------------------------------------------------- pipeline stages
# Model types whose base model's forward, given ``inputs_embeds`` (a later stage's input, the
# hidden states), only runs the decoder layers and the final norm: nothing scales or changes the
# embeddings outside the embedding module (Granite multiplies them, older Gemmas scale them).
PIPELINE_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def pipeline(model: nn.Module) -> list[str]:
    """The modules in forward order: the embedding, each decoder layer, the final norm, the head
    (the rotary embedding has no parameters: every stage keeps it). A model type not in
    :data:`PIPELINE_TYPES` is refused."""
    kind = getattr(model.config, "model_type", None)
    if kind not in PIPELINE_TYPES:
        raise UsageError(
            f"--pp: fsdp2lab splits Hugging Face models of type {', '.join(PIPELINE_TYPES)} into "
            f"pipeline stages, not {kind!r} (a later stage runs the base model's forward on "
            "hidden states, checked to be the model's own for these types only)"
        )
    prefix = model.base_model_prefix
    layers = [f"{prefix}.layers.{i}" for i in model.base_model.layers._modules]
    return [f"{prefix}.embed_tokens", *layers, f"{prefix}.norm", "lm_head"]


def _skip(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A decoder layer another stage holds: its input passes through."""
    return hidden_states


class StageLayers(nn.ModuleList):
    """A stage's decoder layers seen at their places in the whole model, another stage's layer
    as :func:`_skip`: the base model's ``for i, layer in enumerate(self.layers[:n])`` gives each
    layer its own index (``config.layer_types[i]``: its attention mask), and the names of the
    held layers (``model.layers.5``) are unchanged."""

    n_layers: int

    def _places(self) -> list:
        return [self._modules.get(str(i), _skip) for i in range(self.n_layers)]

    def __getitem__(self, index):  # type: ignore[override]
        return self._places()[index]

    def __iter__(self):
        return iter(self._places())

    def __len__(self) -> int:
        return self.n_layers


def pipeline_stage(model: nn.Module) -> None:
    """Make ``model`` (a causal LM with other stages' modules removed) run as one stage: token
    ids in on the first stage, hidden states on the others; hidden states out, except on the last
    stage: the logits of the model's own forward (with its head's scaling or soft-capping)."""
    import types

    from torch.distributed.tensor import DTensor

    base = model.base_model
    first, last = base.embed_tokens is not None, model.get_output_embeddings() is not None
    if base.norm is None:
        base.norm = nn.Identity()  # the last stage's: hidden states leave the others unnormalised
    base.layers.n_layers = model.config.num_hidden_layers
    base.layers.__class__ = StageLayers
    causal_lm_forward = type(model).forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids" if first else "inputs_embeds": x, "use_cache": False}
        if last:
            return causal_lm_forward(self, **inputs).logits
        out = self.base_model(**inputs).last_hidden_state
        # Sequence parallel (TP): this rank's share of the sequence goes to the next stage.
        return out.to_local() if isinstance(out, DTensor) else out

    model.forward = types.MethodType(forward, model)


# ---------------------------------------------------------------------------- tensor parallelism
def _styles() -> dict:
    """transformers' TP style names -> torch's ParallelStyle (the styles dense models use)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }


# Model types whose decoder layers are Llama's (norm, attention, residual; norm, gated MLP,
# residual; q/k/v/o and gate/up/down projections): fsdp2lab's own TP plan,
# :func:`sequence_parallel_plan`. Other types take their own ``base_model_tp_plan``.
SEQUENCE_PARALLEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def tp_plan_of(config) -> Callable[[nn.Module], dict] | None:
    """The TP plan of a model of ``config``: fsdp2lab's sequence-parallel one for the Llama family,
    else the model's own (None where it has none)."""
    if getattr(config, "model_type", None) in SEQUENCE_PARALLEL_TYPES:
        return sequence_parallel_plan
    return tp_plan if getattr(config, "base_model_tp_plan", None) else None


def tp_plan_name(config) -> str:
    kind = getattr(config, "model_type", None)
    if kind in SEQUENCE_PARALLEL_TYPES:
        return (
            f"fsdp2lab's for {kind} (sequence parallel norms and residual stream, "
            "vocabulary-parallel loss)"
        )
    return f"{kind}'s own base_model_tp_plan (no sequence parallelism, logits gathered whole)"


def sequence_parallel_plan(model: nn.Module) -> dict:
    """Megatron-style TP with sequence parallelism for the Llama family (a model, or a pipeline
    stage of one). Between the layers the residual stream is a DTensor sharded on the sequence
    (global shape, so the model's forward derives positions and the mask from the whole
    sequence); each norm runs on its rank's tokens; attention and the MLP all-gather the sequence,
    run on their local heads / columns (q/k/v/gate/up column-wise; ``view(..., -1, head_dim)``
    sees the local heads, as Qwen3's per-head q/k norms do) and reduce-scatter back onto it
    (o/down row-wise). The head's logits stay sharded on the vocabulary (``loss.py``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    prefix, base = model.base_model_prefix, model.base_model
    plan: dict = {
        f"{prefix}.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        f"{prefix}.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if base.embed_tokens is None:  # a later pipeline stage: its input is its share of the sequence
        plan[prefix] = PrepareModuleInput(
            input_kwarg_layouts={"inputs_embeds": Shard(1)},
            desired_input_kwarg_layouts={"inputs_embeds": Shard(1)},
        )
    for i, module in base.layers._modules.items():
        layer = f"{prefix}.layers.{i}"
        # Qwen3's q/k norms (over each head, on the local heads): their weights replicated
        # DTensors, their gradients summed over the tp ranks' heads.
        plan |= {
            f"{layer}.self_attn.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True)
            for norm in ("q_norm", "k_norm")
            if hasattr(module.self_attn, norm)
        }
        plan |= {
            f"{layer}.input_layernorm": SequenceParallel(),
            f"{layer}.self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            **{f"{layer}.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            f"{layer}.self_attn.o_proj": RowwiseParallel(
                output_layouts=Shard(1), use_local_output=False
            ),
            f"{layer}.post_attention_layernorm": SequenceParallel(),
            f"{layer}.mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            f"{layer}.mlp.gate_proj": ColwiseParallel(),
            f"{layer}.mlp.up_proj": ColwiseParallel(),
            f"{layer}.mlp.down_proj": RowwiseParallel(
                output_layouts=Shard(1), use_local_output=False
            ),
        }
    _refuse_tied(model, plan)
    return plan


def _refuse_tied(model: nn.Module, plan: Iterable[str]) -> None:
    """UsageError where the head is the embedding and ``plan`` (module names) shards them as two
    modules."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embedding is None or head.weight is not embedding.weight:
        return
    sharded = [n for n, m in model.named_modules() if m in (head, embedding) and n in plan]
    if sharded:
        raise UsageError(
            f"--tp: {type(model).__name__} ties its output head to its embedding, which its "
            f"TP plan shards as separate modules ({', '.join(sharded)}); use a model with "
            "tie_word_embeddings false, or no --tp"
        )


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own TP plan (transformers: the config's ``base_model_tp_plan`` under the base
    model's prefix, and the head's), its ``*`` expanded to the modules' names."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {}
    names = [name for name, _ in model.named_modules() if name]
    expanded: dict[str, str] = {}
    for pattern, style in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        expanded.update({name: style for name in names if regex.match(name)})
    return expanded


def tp_plan(model: nn.Module) -> dict:
    """``{module name: ParallelStyle}`` from the model's own plan; a style not mapped here, or
    tied embeddings the plan would shard as two modules, is a UsageError naming it."""
    plan = hf_tp_plan(model)
    styles = _styles()
    unmapped = sorted({s for s in plan.values() if s not in styles})
    if not plan:
        raise UsageError(f"--tp: {type(model).__name__} has no tensor-parallel plan")
    if unmapped:
        first = next(name for name, s in plan.items() if s == unmapped[0])
        raise UsageError(
            f"--tp: {type(model).__name__}'s TP plan uses style {unmapped[0]!r} (e.g. {first}), "
            f"which fsdp2lab does not map (it maps: {', '.join(styles)})"
        )
    _refuse_tied(model, plan)
    return {name: styles[style]() for name, style in plan.items()}


def tp_sizes(model: nn.Module) -> dict[str, int]:
    """What ``--tp`` splits: attention and key/value heads, the MLP width, the vocabulary."""
    config = model.config
    sizes = {
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "intermediate_size": getattr(config, "intermediate_size", None),
        "vocab_size": getattr(config, "vocab_size", None),
    }
    return {k: v for k, v in sizes.items() if isinstance(v, int)}
