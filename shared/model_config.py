"""The shape of a Llama-family decoder (``ModelConfig``) and the built-in presets: what the worker
builds (worker/model.py) and what the front door needs of a preset (its vocabulary, for the
built-in byte tokenizer), in one place both may import."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, Mistral, Qwen2 share it)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10_000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    rms_norm_eps: float = 1e-5
    max_position: int = 4096
    qkv_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None  # the layers the window applies to; None: every layer
    eos_token_id: int | None = None  # the first of eos_token_ids
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (default: eos_token_id alone)
    name: str = "custom"

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "max_position"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model {self.name}: {key} must be positive, got {getattr(self, key)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name}: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads} (GQA groups must be whole)"
            )
        if self.head_size == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"model {self.name}: set head_size; hidden_size % num_heads != 0")
            object.__setattr__(self, "head_size", self.hidden_size // self.num_heads)
        if self.head_size % 2:
            raise ValueError(f"model {self.name}: head_size must be even for RoPE, got {self.head_size}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"model {self.name}: sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.sliding_layers is not None and not all(0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"model {self.name}: sliding_layers {self.sliding_layers} name layers outside "
                             f"0..{self.num_layers - 1}")
        if not self.eos_token_ids and self.eos_token_id is not None:
            object.__setattr__(self, "eos_token_ids", (self.eos_token_id,))
        if self.eos_token_ids and self.eos_token_id != self.eos_token_ids[0]:
            raise ValueError(f"model {self.name}: eos_token_id {self.eos_token_id} must be the first of "
                             f"eos_token_ids {self.eos_token_ids}")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: it attends to the whole context)."""
        if self.sliding_layers is None or layer in self.sliding_layers:
            return self.sliding_window
        return None


PRESETS: dict[str, ModelConfig] = {
    # Fast on CPU: tests, the demo.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, max_position=2048, eos_token_id=1, name="tiny"),
    # Big enough that batching pays on CPU: the worker benchmark.
    "small": ModelConfig(vocab_size=2048, hidden_size=512, intermediate_size=1408, num_layers=4,
                         num_heads=8, num_kv_heads=2, max_position=4096, eos_token_id=1,
                         name="small"),
    "llama-3-8b": ModelConfig(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336,
                              num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=500_000.0,
                              max_position=8192, eos_token_id=128_001, name="llama-3-8b"),
    "llama-3.2-1b": ModelConfig(vocab_size=128_256, hidden_size=2048, intermediate_size=8192,
                                num_layers=16, num_heads=32, num_kv_heads=8, head_size=64,
                                rope_theta=500_000.0, max_position=131_072, tie_embeddings=True,
                                eos_token_id=128_001, name="llama-3.2-1b"),
    "qwen2-0.5b": ModelConfig(vocab_size=151_936, hidden_size=896, intermediate_size=4864,
                              num_layers=24, num_heads=14, num_kv_heads=2, rope_theta=1_000_000.0,
                              rms_norm_eps=1e-6, max_position=32_768, qkv_bias=True,
                              tie_embeddings=True, eos_token_id=151_643, name="qwen2-0.5b"),
}
