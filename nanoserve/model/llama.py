"""The Llama forward over a paged KV cache, for a flat batch of tokens from many sequences.

One step's tokens (whole or partial prompts and single decode tokens, concatenated) go
through every layer's projections and MLP as one [T, hidden] matrix, which is where almost
all the flops are (model/linear.py: pre-packed weights). Only attention cares which sequence
a token belongs to (model/attention.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from nanoserve.model import native, ops
from nanoserve.model.architectures import text_weights
from nanoserve.model.attention import DECODE_GROUP_BYTES, NATIVE_HEAD_DIMS
from nanoserve.model.base import ForwardBatch, ModelConfig
from nanoserve.model.linear import mkl_packing_available
from nanoserve.model.loader import ensure_float_weights, load_model_config
from nanoserve.model.placement import Placement, decode_stack_weights, place_weights
from nanoserve.model.quant import QuantProj, QuantWeight
from nanoserve.model.self_attention import self_attention
from nanoserve.model.step import StepPlan, plan_step, rope_tables


def load_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    ensure_float_weights(Path(folder))
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    return text_weights(weights)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor | QuantWeight],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        pack_weights: bool | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        isa: str | None = None,
    ) -> None:
        self.config = config
        # Tensor parallelism (model/parallel/): the sum over the ranks of a row-parallel
        # projection's partial output (o and down), in place or as a new tensor; None alone.
        self.reduce = reduce
        self.device = torch.device(device)
        self.dtype = dtype
        self._choose_kernels(pack_weights, isa)
        self._place_weights(weights)
        self._cos, self._sin = rope_tables(config, self.device, dtype)
        self._local_rope = (rope_tables(config, self.device, dtype, local=True)
                            if config.local_layers else None)
        self.kv_cache: torch.Tensor | None = None  # [L, 2, num_blocks * block_size, KV, D]
        self.block_size = 0

    def _choose_kernels(self, pack_weights: bool | None, isa: str | None) -> None:
        """Which kernels this model runs on, decided once from its device and dtype."""
        if pack_weights is None:  # wherever it is possible
            pack_weights = (self.device.type == "cpu" and self.dtype == torch.float32
                            and mkl_packing_available())
        self.pack_weights = pack_weights
        self.decode_group_bytes = DECODE_GROUP_BYTES
        # nanoserve's own CPU kernels where they apply (model/native.py): fused elementwise
        # layer parts, and decode attention for the head sizes it is compiled for; built for
        # the instruction set `isa` (default: NANOSERVE_ISA, else the CPU's best).
        self.kernels = (native.kernels(isa) if self.device.type == "cpu"
                        and self.dtype == torch.float32 else None)
        self.native_layers = self.kernels is not None
        self.native_attention = (self.native_layers
                                 and self.config.head_dim in NATIVE_HEAD_DIMS)
        # Quantized weights (model/quant.py) run on nanoserve's kernels: float32 on the CPU.
        self.quantized = self.native_layers

    def _place_weights(self, weights: Mapping[str, torch.Tensor | QuantWeight]) -> None:
        """The checkpoint's tensors in the form this model runs them (model/placement.py),
        and the decode stack's lists where it runs."""
        placed = place_weights(self.config, weights, Placement(
            self.device, self.dtype, self.kernels, self.quantized, self.pack_weights))
        self.embed, self.embed_q, self.norm = placed.embed, placed.embed_q, placed.norm
        self.lm_head, self.layers = placed.lm_head, placed.layers
        self.embed_scale = placed.embed_scale
        self.stack = decode_stack_weights(self.layers,
                                          self.native_attention and self.reduce is None)

    def use_act8(self, suffix: str) -> int:
        """Batch-1 projections (the layers' and the LM head) on 8-bit activations
        (`--int8-activations`: csrc/q8dot.cpp; `suffix` from native.act8_suffix), in the
        decode stack too; returns how many projections take it."""
        projs = [self.lm_head, *(p for ly in self.layers
                                 for p in (ly.qkv, ly.o, ly.gate_up, ly.down))]
        quant = [p for p in projs if isinstance(p, QuantProj)]
        for p in quant:
            p.act8 = suffix
        self.stack = decode_stack_weights(self.layers,
                                          self.native_attention and self.reduce is None)
        return len(quant) if suffix else 0

    @classmethod
    def from_folder(
        cls, folder: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
        pack_weights: bool | None = None,
    ) -> LlamaModel:
        return cls(load_model_config(Path(folder)), load_weights(folder), device=device,
                   dtype=dtype, pack_weights=pack_weights)

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every projection and the LM head, in
        whatever form they are held (quantized blocks or float32), and the norms."""
        projs = [self.lm_head, *(p for ly in self.layers
                                 for p in (ly.qkv, ly.o, ly.gate_up, ly.down))]
        total = sum(p.weight.blocks.nbytes if isinstance(p, QuantProj)
                    else p.weight.nbytes for p in projs)
        norms = [self.norm, *(t for ly in self.layers for t in (ly.attn_norm, ly.mlp_norm))]
        return total + sum(t.nbytes for t in norms)

    # ---- KV cache -------------------------------------------------------------------------

    def kv_bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return block_size * self.config.kv_bytes_per_token(elem)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        c = self.config
        self.block_size = block_size
        self.kv_cache = torch.zeros(
            (c.num_layers, 2, num_blocks * block_size, c.num_kv_heads, c.head_dim),
            device=self.device, dtype=self.dtype,
        )

    @torch.inference_mode()
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        cache = self._cache()
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        blocks = cache.view(*cache.shape[:2], -1, self.block_size, *cache.shape[3:])
        # The right side is gathered before any write, so chains like (1->2, 2->3) copy the
        # old block 2, as if all pairs were copied at once.
        blocks[:, :, dst] = blocks[:, :, src]

    def _cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("init_kv_cache() must be called before forward()")
        return self.kv_cache

    # ---- forward --------------------------------------------------------------------------

    def pick_greedy(self, batch: ForwardBatch) -> None:
        """No cheaper way to an argmax than the logits: the engine runs `forward`."""
        return None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.hidden(batch)
        # The head runs outside inference mode so that the logits are an ordinary tensor: a
        # sampler may then scale or mask them in place (inference tensors forbid that).
        with torch.no_grad():
            return self.lm_head(h).float()  # [R, vocab]

    def hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """Run every layer; the final-normed hidden states [R, hidden] at the logits rows
        (what the LM head takes; tensor-parallel ranks other than 0 stop here)."""
        cache = self._cache()
        nat = self.kernels if self.native_layers else None
        reduce = self.reduce or (lambda t: t)
        with torch.inference_mode():
            plan = plan_step(batch, self.config, cache, self.block_size, self._cos, self._sin,
                             stock=not self.native_layers,
                             native_attention=self.native_attention,
                             group_bytes=self.decode_group_bytes, device=self.device,
                             local_rope=self._local_rope)
            eps, gelu = self.config.rms_norm_eps, self.config.gelu_mlp
            x = self._embed(plan.input_ids)  # [T, hidden], the residual stream
            ap = plan.attention
            if (self.stack is not None and ap.native is not None and not ap.groups
                    and not ap.prefills):
                m = self._decode_stack(x, plan)
            else:
                h = ops.rms_norm(x, self.layers[0].attn_norm, eps, native=nat)
                for i, layer in enumerate(self.layers):
                    a = reduce(self_attention(self.config, layer, h, cache[i], plan,
                                              plan.attention_for(i), self.kernels, nat))
                    a = ops.norm_if(a, layer.post_attn_norm, eps, native=nat)
                    h = ops.add_rms_norm(x, a, layer.mlp_norm, eps, native=nat)  # x += a
                    m = reduce(layer.down(ops.gate_mul(layer.gate_up(h), gelu=gelu,
                                                       native=nat)))
                    m = ops.norm_if(m, layer.post_mlp_norm, eps, native=nat)
                    if i + 1 < len(self.layers):
                        h = ops.add_rms_norm(x, m, self.layers[i + 1].attn_norm, eps,
                                             native=nat)
            # The last residual add, final norm and LM head only where logits are wanted:
            # an unfinished prefill chunk needs none, and the head is the largest matrix.
            idx = plan.logits_indices
            out: torch.Tensor = ops.rms_norm(x[idx] + m[idx], self.norm, eps, native=nat)
            return out

    def _decode_stack(self, x: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Every layer of a decode-only step in one native call; returns the last MLP
        output (x, the residual, is updated in place as the layer loop updates it)."""
        c, n, s = self.config, plan.attention.native, self.stack
        assert n is not None
        assert s is not None
        assert self.kernels is not None
        windowed = plan.windowed_attention
        window = windowed.native.window if windowed is not None and windowed.native else 0
        windows = [window if i in plan.window_layers else 0 for i in range(c.num_layers)]
        m: torch.Tensor = self.kernels.ops.decode_stack(
            x, *s.args(x.shape[0]), self._cache(), plan.cos, plan.sin, plan.local_cos,
            plan.local_sin, s.local_rope, windows, plan.positions, plan.slot_mapping, n.rows,
            n.block_tables, n.context_lens, self.block_size, c.num_heads, c.num_kv_heads,
            c.head_dim, c.attention_scale, c.rms_norm_eps, c.gelu_mlp)
        return m

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_q is not None:
            x = self.embed_q.take_rows(ids, self.kernels)
        else:
            assert self.embed is not None
            x = F.embedding(ids, self.embed)
        return x if self.embed_scale is None else x.mul_(self.embed_scale)
