"""Writes a tiny random-weight llama-architecture GGUF that llama.cpp loads and generates from.

No model can be downloaded here, so the real-server tests make their own: two layers of
64 dimensions, a SentencePiece-style vocabulary built in code (the three specials, the
256 byte-fallback pieces, ASCII characters and a few words), a chat template, and mean
pooling so the same file also serves embeddings. Its output is gibberish, but greedy
decoding (temperature 0) makes it the same gibberish for the same prompt; the rows of
the output matrix for the specials and the byte pieces are zero, so greedy decoding
never picks them (the text stays printable ASCII and runs until ``max_tokens``).

Runs in the llama-cpp-python virtualenv (``gguf`` and ``numpy`` live there, not in iop's):

    .venv-servers/llamacpp/bin/python tests/realservers/tiny_gguf.py OUT.gguf [SEED]

Another SEED writes other weights under the same shapes and vocabulary: another model that
loads and answers alike, but answers other words (what a wrong model served under an id is).
"""

from __future__ import annotations

import string
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# gguf and numpy are imported where used: the tests import the sizes below from iop's
# virtualenv, which has neither.
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
N_LAYER = 2
N_CTX = 2048
SEED = 20240611

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

WORDS = [
    "hello", "world", "the", "of", "and", "to", "in", "is", "it", "that", "tiny", "model", "random",
    "llama", "token", "stream", "chunk", "answer", "question", "server", "queue", "worker", "redis",
    "provider", "alpha", "beta", "gamma", "delta", "red", "green", "blue", "cat", "dog", "sun", "moon",
]


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of an SPM vocabulary: <unk> <s> </s>, <0x00>..<0xFF>, pieces."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    pieces: list[str] = ["\u2581"]
    for ch in string.ascii_letters + string.digits + string.punctuation:
        pieces += [ch, "\u2581" + ch]
    # Every prefix of a word is a piece too, so SentencePiece's merges can reach the word.
    for word in WORDS:
        for end in range(2, len(word) + 1):
            for piece in (word[:end], "\u2581" + word[:end]):
                if piece not in pieces:
                    pieces.append(piece)
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    # Longer pieces score higher, so they win the merges.
    scores = [0.0] * (3 + 256) + [float(len(p)) - 100.0 for p in pieces]
    return tokens, scores, [int(t) for t in types]


def write(path: str, seed: int = SEED) -> None:
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)
    head_dim = N_EMBD // N_HEAD

    w = gguf.GGUFWriter(path, "llama")
    w.add_name("iop-tiny-random")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def rand(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    # numpy shapes are (rows, cols) = GGML's ne reversed.
    w.add_tensor("token_embd.weight", rand(n_vocab, N_EMBD, scale=1.0))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    output = rand(n_vocab, N_EMBD, scale=1.0)
    output[: 3 + 256] = 0.0  # specials and byte pieces: never the greedy choice
    w.add_tensor("output.weight", output)
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand(N_HEAD * head_dim, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand(N_HEAD_KV * head_dim, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand(N_HEAD_KV * head_dim, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(N_EMBD, N_HEAD * head_dim))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(N_EMBD, N_FF))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: tiny_gguf.py OUT.gguf [SEED]")
    write(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else SEED)
