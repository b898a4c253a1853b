"""Engine settings: everything that changes the schedule, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """An engine setting that cannot work; the message names the setting."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    # None: as many blocks as `kv_cache_memory` bytes hold (the stub, which keeps no KV,
    # gets `stub_num_blocks`).
    num_blocks: int | None = None
    kv_cache_memory: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # None: the model's own context length.
    max_model_len: int | None = None
    prefix_caching: bool = True
    seed: int = 0
    stub_num_blocks: int = 1024

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "stub_num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1 or unset, got {value!r}")
        if self.kv_cache_memory < 1:
            raise ConfigError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
