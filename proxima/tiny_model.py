"""Build a tiny Llama-architecture model on disk: config, seeded random weights, local BPE tokenizer.

No downloads. The weights are real (a fixed seed, a wide init) rather than vLLM's `dummy` load, so
that greedy decoding has well-separated logits: outputs of two attention implementations then agree
token for token unless one of them is wrong, not because of rounding ties.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from proxima.files import write_atomic
from proxima.load import WORDS

logger = logging.getLogger(__name__)

CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 4096
    seed: int = 0
    init_std: float = 0.2


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # Trained on the words generated load is made of (the doctor's, the demo's, the tests'), so
    # each of them is one token.
    corpus = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(40)) + f" {i}" for i in range(2000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a loadable model directory and return its path. Existing files are replaced atomically."""
    from safetensors.torch import save

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(spec.vocab_size)
    vocab = tok.get_vocab_size()

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    tensors = _random_weights(spec, vocab)

    write_atomic(out / "tokenizer.json", tok.to_str())
    write_atomic(
        out / "tokenizer_config.json",
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": spec.max_position_embeddings,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        ),
    )
    write_atomic(out / "config.json", json.dumps(config, indent=1))
    write_atomic(out / "generation_config.json", json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    write_atomic(out / "proxima_tiny_spec.json", json.dumps(asdict(spec), indent=1))
    write_atomic(out / "model.safetensors", save(tensors))
    logger.info("tiny model written to %s (vocab %d)", out, vocab)
    return out


def _random_weights(spec: TinyModelSpec, vocab: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(spec.seed)

    def rand(*shape: int, std: float = spec.init_std) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * d, spec.num_key_value_heads * d
    tensors = {
        "model.embed_tokens.weight": rand(vocab, h, std=1.0),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": rand(vocab, h),
    }
    for layer in range(spec.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rand(q_out, h),
            p + "self_attn.k_proj.weight": rand(kv_out, h),
            p + "self_attn.v_proj.weight": rand(kv_out, h),
            p + "self_attn.o_proj.weight": rand(h, q_out),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
        }
    return tensors
