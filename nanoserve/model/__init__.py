"""Models behind one protocol (base.py): real Llama weights and the weightless stub.

    llama.py      the Llama forward over the paged KV cache; attention.py its attention
    self_attention.py  a layer's attention in the layer loop: qkv, norms, RoPE, attend, o
    placement.py  a checkpoint's tensors placed for the forward: fused, float32 or quantized
    step.py       one step's inputs to the forward: index tensors, RoPE rows, attention plan
    quant.py      quantized weights (GGUF blocks) and their projections
    options.py    LoadOptions: how `load` loads a model (device, dtype, quantization, TP)
    native.py     the CPU kernels (layers, attention, quantized, 8-bit decode, stack), once
                  per instruction set, and the run-time choice among them; built by
                  native_build.py (csrc/ compiled, cached by digest); isa_support.py which
                  sets a CPU runs, isa_timing.py what `auto` times, isa_choice.py its choice
                  kept as JSON
    cpu.py        what the CPU advertises and the OS has enabled (XCR0), oneDNN held to it
    cache.py      where converted models and built kernels are kept
    ops.py        a layer's elementwise parts: one native kernel each, or stock PyTorch ops
    linear.py     a float weight multiply in the device's fastest form (MKL's packed sgemm)
    stub.py       the stub: logits from (seed, history), for simulation and tests
    stub_says.py  what the stub is told to say: a prompt's script, a recorded output, copying
    loader.py     a model name or path -> a Hugging Face folder, converted once and cached
    gguf.py       reading a llama GGUF: tensors, metadata, tokenizer
    gguf_file.py  a GGUF's header in one pass: metadata values and tensor views
    hub.py        models by Hugging Face Hub id (`org/name`, `org/name:Q4_K_M`, `@revision`)
    architectures.py  the architectures nanoserve runs, as a config.json names and shapes them
    weights.py    a model's weights by name, before any model is built (every TP rank's way)
    preflight.py  a model setting judged before anything loads (device, TP size, KV pool)
    unpack.py     GGUF blocks taken apart into quants, scales and offsets, for the panels
    panels.py     quantized weights repacked into panels of 16 rows, for many-row steps
    int8.py       8-bit activations for the large multiplies (`--int8-activations`)
    parallel/     tensor parallelism on torch.distributed (its own map)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from nanoserve.model.base import ForwardBatch, Model, ModelConfig
from nanoserve.model.options import LoadOptions
from nanoserve.tokenizer import Tokenizer

__all__ = ["ForwardBatch", "LoadOptions", "Model", "ModelConfig", "kv_geometry", "load"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DEFAULTS = LoadOptions()  # load's default: one shared value (a frozen one)


def load(name: str, options: LoadOptions = _DEFAULTS, **changes: Any
         ) -> tuple[Model, Tokenizer]:
    """`smollm2` (the embedded model), `stub`, or a path to a Hugging Face Llama folder or a
    GGUF file, loaded as `options` say (model/options.py) with `changes` made to them by
    field name (`load(name, device="cuda")`; an unknown name is a TypeError). The stub uses
    SmolLM2's tokenizer, so its text behaves like the real model's."""
    from nanoserve.model.loader import EMBEDDED, resolve_model
    from nanoserve.model.weights import check_choices, llama_weights, torch_dtype

    o = replace(options, **changes) if changes else options
    check_choices(o.dtype, o.quantization)
    if o.int8_activations and (name == "stub" or o.tensor_parallel_size != 1
                               or o.device != "cpu"):
        raise ValueError("int8_activations: runs on real weights on the CPU, in one process "
                         "(not with the stub, tensor parallelism or another device)")
    if name == "stub":
        return _stub(o.device, o.stub_eos_prob, o.tensor_parallel_size)
    folder = resolve_model(name) if name in EMBEDDED else resolve_model(str(Path(name)))
    tok = Tokenizer.from_folder(folder)
    if o.tensor_parallel_size != 1:
        from nanoserve.model.parallel import LoadSpec, TensorParallelModel

        spec = LoadSpec(name, o.device, o.dtype, o.quantization)
        timeouts = {k: v for k, v in (("timeout_s", o.distributed_timeout),
                                      ("heartbeat_timeout_s", o.distributed_heartbeat_timeout))
                    if v is not None}
        return TensorParallelModel(spec, o.tensor_parallel_size, backend=o.distributed_backend,
                                   exact=o.tp_exact, **timeouts), tok
    from nanoserve.model.llama import LlamaModel

    config, weights = llama_weights(name, device=o.device, dtype=o.dtype,
                                    quantization=o.quantization)
    model = LlamaModel(config, weights, device=o.device, dtype=torch_dtype(o.dtype))
    if o.int8_activations:
        from nanoserve.model.int8 import (
            CALIBRATION_TEXT,
            attach,
            int8_gemm_pays,
            int8_projections,
        )

        if int8_gemm_pays():  # else the prefill keeps its exact path (int8.py says why)
            attach(model, int8_projections(model.layers), tok.encode(CALIBRATION_TEXT))
        if model.kernels is not None:  # batch-1 steps: csrc/q8dot.cpp
            from nanoserve.model.native import act8_suffix

            model.use_act8(act8_suffix(model.kernels.isa))
    return model, tok


def _stub(device: str, eos_prob: float, tensor_parallel_size: int) -> tuple[Model, Tokenizer]:
    """The stub model, with SmolLM2's tokenizer so that its text behaves like the real one's."""
    from nanoserve.model.loader import resolve_model
    from nanoserve.model.stub import StubModel

    if tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size: the stub model has no weights to shard; "
                         "it runs at 1")
    tok = Tokenizer.from_folder(resolve_model("smollm2"))
    return StubModel(tok, eos_prob=eos_prob, device=device), tok


def kv_geometry(name: str, dtype: str = "float32", tensor_parallel_size: int = 1
                ) -> tuple[int, int]:
    """(context length, KV-cache bytes per token) of the model `load(name, dtype=dtype)`
    would load, read from its metadata without loading or converting weights: what
    `EngineConfig.layout` needs to judge a configuration before a server binds its socket.
    With tensor parallelism the bytes are one rank's (its KV heads): the pool is sized per
    rank. Raises OSError or ValueError for a model that cannot be found or read, or that
    does not shard at `tensor_parallel_size`."""
    if name == "stub":
        from nanoserve.model.stub import STUB_CONTEXT

        return STUB_CONTEXT, 0  # the stub keeps no KV
    from nanoserve.model.loader import peek_config

    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    config = peek_config(name)
    if tensor_parallel_size != 1:
        from nanoserve.model.parallel.shard import check_tp_size, local_config

        check_tp_size(config, tensor_parallel_size)
        config = local_config(config, tensor_parallel_size)
    return config.max_position_embeddings, config.kv_bytes_per_token(_DTYPE_BYTES[dtype])
