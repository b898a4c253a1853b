"""The offline API a vLLM user already knows: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from nanoserve.config import EngineConfig, SpeculativeConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import OutputBuilder, RequestOutput
from nanoserve.model import LoadOptions, Model, load
from nanoserve.progress import bar
from nanoserve.sampling.params import SamplingParams
from nanoserve.tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    def __init__(
        self,
        model: str = "smollm2",
        *,
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        **kwargs: Any,
    ) -> None:
        """`kwargs`: LoadOptions' fields (model/options.py: device, dtype, quantization,
        tensor_parallel_size, ...) and EngineConfig's (config.py: num_blocks, max_num_seqs,
        ...), by name, as vLLM's LLM takes them; any other name is a TypeError.
        `tensor_parallel_size` > 1 shards the weights over that many processes
        (nanoserve.model.parallel); `close()` stops them (they also stop at exit). They are
        fresh interpreters, so a script needs no `if __name__ == "__main__":` guard.
        `distributed_timeout`: seconds they may take to start (default 600);
        `distributed_heartbeat_timeout`: seconds of silence after which a rank is taken as
        lost (default 5). A start that fails raises ModelStartError naming the rank.
        `int8_activations`: prefill-sized projections on 8-bit activations (model/int8.py),
        faster and no longer token-identical.
        `speculative_config`: vLLM's (a dict, as its JSON), or a SpeculativeConfig:
        speculative decoding (engine/speculative.py), the same tokens in fewer steps."""
        options, engine_kwargs = _split(kwargs)
        m, tok = load(model, options)
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig.parse(speculative_config)
        self.engine = Engine(m, tok, EngineConfig(speculative=speculative_config,
                                                  **engine_kwargs))

    def close(self) -> None:
        """Release what the model holds outside this process (tensor-parallel ranks)."""
        close = getattr(self.engine.model, "close", None)
        if close is not None:
            close()

    @classmethod
    def from_parts(cls, model: Model, tokenizer: Tokenizer, config: EngineConfig) -> LLM:
        self = cls.__new__(cls)
        self.engine = Engine(model, tokenizer, config)
        return self

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; results in prompt order.
        `use_tqdm`: a progress bar over the prompts, on a terminal (as vLLM's)."""
        plist: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            plist = [prompts]  # type: ignore[list-item]
        else:
            plist = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        per = list(params) if isinstance(params, Sequence) else [params] * len(plist)
        if len(per) != len(plist):
            raise ValueError(f"{len(plist)} prompts but {len(per)} SamplingParams")
        prepared = [self.engine.prepare(p, sp) for p, sp in zip(plist, per, strict=True)]
        builders: dict[str, OutputBuilder] = {}
        for prep in prepared:
            rid = self.engine.admit(prep)
            builders[rid] = OutputBuilder(rid, prep.prompt_ids, prep.params.n)
        shown = bar(len(builders), "Processed prompts", enabled=use_tqdm, unit="prompt")
        tokens = 0
        while self.engine.has_unfinished():
            for u in self.engine.step().updates:
                b = builders[u.request_id]
                b.add(u)
                tokens += len(u.new_token_ids)
                if u.finished and b.finished:
                    shown.update(1)
                    shown.set_postfix_str(f"{tokens} output tokens", refresh=False)
        shown.close()
        return [b.build() for b in builders.values()]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
    ) -> RequestOutput:
        return self.generate(self.tokenizer.encode_chat(messages), params)[0]


def _split(kwargs: Mapping[str, Any]) -> tuple[LoadOptions, dict[str, Any]]:
    """`LLM(...)`'s keywords as the model's LoadOptions and the rest, EngineConfig's: by the
    two dataclasses' field names, so that neither list is written out again here. A name
    that is neither's is refused before anything loads."""
    load_names = {f.name for f in fields(LoadOptions)}
    # EngineConfig's `speculative` is given as vLLM's `speculative_config`, never by its name.
    engine_names = {f.name for f in fields(EngineConfig)} - {"speculative"}
    unknown = sorted(set(kwargs) - load_names - engine_names)
    if unknown:
        raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
    return (LoadOptions(**{k: v for k, v in kwargs.items() if k in load_names}),
            {k: v for k, v in kwargs.items() if k not in load_names})
