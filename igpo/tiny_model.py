"""Build a tiny random Qwen2-architecture causal LM and a byte-level BPE tokenizer locally (no model hub).

The CPU demo and the tests need a real Hugging Face checkpoint that verl can load with ``AutoModelForCausalLM`` and
``AutoTokenizer``. We train a small byte-level BPE on a local text file, add the chat and tool tags as single tokens
(as Qwen tokenizers do), attach a ChatML chat template, and save a randomly initialised ``Qwen2ForCausalLM``.
The result is cached: a second call with the same settings returns the existing directory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

# Special tokens that structure a chat; the pad/end-of-text token comes first so it gets id 0.
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Tags the agent protocol uses; each is one token so masks and turn ends line up with tags exactly.
TAG_TOKENS = (
    "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<answer>", "</answer>",
)

# ChatML, as used by Qwen2.5/Qwen3: tools (when given) are listed in the system turn; tool results are user turns
# wrapped in <tool_response> by the agent loop, so the template needs no special "tool" role handling beyond ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{%- endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
    "{%- set start = 1 if messages[0]['role'] == 'system' else 0 %}"
    "{%- else %}{%- set start = 0 %}{%- endif %}"
    "{%- for message in messages[start:] %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model. Defaults: ~0.3M parameters, fast enough for verl's trainer on two CPU cores."""

    vocab_size: int = 2048
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 8192
    seed: int = 0

    def fingerprint(self, corpus: Path) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode())
        digest.update(CHAT_TEMPLATE.encode())
        digest.update(corpus.read_bytes())
        return digest.hexdigest()[:16]


def _corpus_lines(corpus: Path) -> Iterator[str]:
    """Text lines of a JSONL corpus (``contents`` or ``text`` field) or a plain text file."""
    with corpus.open(encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            if corpus.suffix == ".jsonl":
                record = json.loads(line)
                yield record.get("contents") or record.get("text") or ""
            else:
                yield line


def _protocol_lines() -> Iterable[str]:
    """Strings the agent protocol produces, so the BPE learns compact tokens for them."""
    yield '{"name": "search", "arguments": {"query": ["'
    yield '{"name": "visit", "arguments": {"url": ["corpus://'
    yield "Now there's enough information to answer"
    yield "user assistant system"
    yield "Doc 1 Title: "


def build_tokenizer(corpus: Path, spec: TinyModelSpec):
    """Train a byte-level BPE on ``corpus`` and wrap it as a ``PreTrainedTokenizerFast`` with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(TAG_TOKENS),
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Protocol strings are repeated so that BPE merges them into few tokens (short, cheap tool calls).
    lines = list(_corpus_lines(corpus)) + list(_protocol_lines()) * 200
    bpe.train_from_iterator(lines, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[],
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    # Tags are added as normal (non-special) tokens: they survive skip_special_tokens decoding, like Qwen's.
    tokenizer.add_tokens(list(TAG_TOKENS))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(out_dir: str | Path, corpus: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Create (or reuse) a tiny random Qwen2 checkpoint with its tokenizer in ``out_dir``.

    Args:
        out_dir: directory to write; reused as is when its recorded fingerprint matches ``spec`` and ``corpus``.
        corpus: a local JSONL corpus (``{"contents": ...}`` per line) or text file to train the tokenizer on.
        spec: model shape; defaults to :class:`TinyModelSpec`.
    Returns:
        The checkpoint directory, loadable with ``AutoModelForCausalLM`` / ``AutoTokenizer``.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    spec = spec or TinyModelSpec()
    out_dir, corpus = Path(out_dir), Path(corpus)
    if not corpus.is_file():
        raise FileNotFoundError(f"tiny model: corpus file {corpus} not found; pass a JSONL corpus such as "
                                "data/wiki_passages_1000.jsonl")
    stamp = out_dir / "igpo_tiny_model.json"
    fingerprint = spec.fingerprint(corpus)
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == fingerprint:
        return out_dir

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(corpus, spec)
    torch.manual_seed(spec.seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stamp.write_text(json.dumps({"fingerprint": fingerprint, "spec": asdict(spec)}, indent=1))
    return out_dir


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to create or reuse")
    parser.add_argument("--corpus", required=True, help="JSONL corpus or text file for the tokenizer")
    args = parser.parse_args()
    print(build_tiny_model(args.out, args.corpus))


if __name__ == "__main__":
    main()
