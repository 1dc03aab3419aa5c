"""Build a tiny Llama checkpoint on disk, so that real vLLM engines run without a model hub.

The model (hidden 128, 2 layers, vocab 1024) and its WordLevel tokenizer are made with
`transformers` and `tokenizers` from a seed, saved as safetensors, and load in vLLM in well
under a second. Tests, benchmarks and the end-to-end example build it once and share it.
`perturbed_weights` makes the "next policy version" a trainer would publish.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


class TinyModelSpec(msgspec.Struct, frozen=True):
    """Shape of the tiny Llama. The defaults are what the tests and benchmarks use."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    # A wider init than the usual 0.02 gives peaked logits, so greedy decoding is not
    # decided by float rounding and vLLM and transformers agree token for token.
    initializer_range: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size <= len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}, got {self.vocab_size}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_attention_heads}"
            )


def word(token_id: int) -> str:
    """The vocabulary entry of a non-special token id."""
    return f"w{token_id}"


def build_tiny_model(directory: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write config, tokenizer and safetensors weights of a seeded tiny Llama to `directory`."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): i for i in range(len(SPECIAL_TOKENS), spec.vocab_size)})
    core = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def perturbed_weights(model_dir: str | Path, seed: int, scale: float = 0.5) -> dict[str, object]:
    """The tiny model's weights plus seeded noise: a stand-in for the trainer's next version.

    Returns name → CPU float32 tensor, in the checkpoint's own names, ready for
    `save_file`. The noise is large enough that greedy outputs change.
    """
    import torch
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, object] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            weights[name] = (tensor.float() + scale * noise * tensor.float().std()).contiguous()
    return weights
