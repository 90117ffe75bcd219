"""Build a tiny random Qwen2-architecture causal LM and a byte-level BPE tokenizer locally (no model hub).

The CPU demo and the tests need a real Hugging Face checkpoint that verl can load with ``AutoModelForCausalLM`` and
``AutoTokenizer``. We train a small byte-level BPE on a local text file, add the chat and tool tags as single tokens
(as Qwen tokenizers do), attach a ChatML chat template, and save a randomly initialised ``Qwen2ForCausalLM``.
The result is cached: a second call with the same settings returns the existing directory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
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
    """Shape of the tiny model. Defaults: ~0.3M parameters, fast enough for verl's trainer on two CPU cores.

    extra_tokens: whole words added to the tokenizer as single tokens (the demo world's handles, tags and cities).
    copy_steps: steps of copy pre-training (:func:`pretrain_copy`, on ``extra_tokens``) after the random init; 0
        leaves the model random.
    """

    vocab_size: int = 2048
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 8192
    seed: int = 0
    extra_tokens: tuple[str, ...] = ()
    copy_steps: int = 0

    def fingerprint(self, corpus: Path) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode())
        digest.update(CHAT_TEMPLATE.encode())
        digest.update(corpus.read_bytes())
        return digest.hexdigest()[:16]


BUILD_THREADS = 2  # torch threads of the copy pre-training (the warm-start's WarmStartConfig.threads is 2 as well)

# The CPU demo's policy (bash train_igpo.sh without a GPU): ~1.6M parameters, copy pre-trained, ~6 s per RL step of
# 32 trajectories on two cores. Its extra tokens come from the demo world (vocabulary.txt).
DEMO_SPEC = TinyModelSpec(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, seed=1, copy_steps=400)


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
    vocab = tokenizer.get_vocab()
    tokenizer.add_tokens([t for t in dict.fromkeys(spec.extra_tokens) if t not in vocab])
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
    spec = spec or TinyModelSpec()
    out_dir, corpus = Path(out_dir), Path(corpus)
    if not corpus.is_file():
        raise FileNotFoundError(f"tiny model: corpus file {corpus} not found; pass a JSONL corpus such as "
                                "data/wiki_passages_1000.jsonl")
    stamp = out_dir / "igpo_tiny_model.json"
    fingerprint = spec.fingerprint(corpus)
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == fingerprint:
        return out_dir  # before importing torch: the launcher checks this cache on every run
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

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
    copy_report = {}
    if spec.copy_steps:
        if not spec.extra_tokens:
            raise ValueError("tiny model: copy_steps needs extra_tokens (the entities to copy), e.g. the demo world's "
                             "vocabulary.txt")
        # A fixed thread count: a reduction split over another number of threads rounds differently, and the model
        # would differ from one machine to the next by its core count.
        threads = torch.get_num_threads()
        torch.set_num_threads(BUILD_THREADS)
        try:
            copy_report = pretrain_copy(model, tokenizer, spec.extra_tokens, spec.copy_steps, seed=spec.seed)
        finally:
            torch.set_num_threads(threads)
    stamp.unlink(missing_ok=True)  # a half-written directory must not look finished
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stamp.write_text(json.dumps({"fingerprint": fingerprint, "spec": asdict(spec), "copy": copy_report}, indent=1))
    return out_dir


def copy_triggers(tokenizer) -> list[int]:
    """Ids of the tokens after which the agent protocol writes a name: the opening of a search query's string
    (the last token of ``{"query": ["``) and ``<answer>``."""
    return [tokenizer.encode('{"query": ["')[-1], tokenizer.convert_tokens_to_ids("<answer>")]


def pretrain_copy(model, tokenizer, entities: tuple[str, ...], steps: int, *, lr: float = 3e-3, length: int = 256,
                  batch: int = 16, max_gap: int = 40, seed: int = 0) -> dict:
    """Teach a random causal LM to refer back: in sequences of random non-entity tokens with entity tokens mentioned
    here and there, every trigger token (``copy_triggers``) is followed by the entity mentioned last, 1 to
    ``max_gap`` tokens earlier; next-token loss on those positions only. This is the one skill of a pretrained LM
    the CPU demo needs (writing a name just read into a query or an answer); it carries no fact, question or
    protocol of the demo. Returns the loss at the start and at the end and the seconds taken.
    """
    import random
    import time

    import torch

    vocab = len(tokenizer)
    entity_ids = tokenizer.convert_tokens_to_ids(list(entities))
    triggers = copy_triggers(tokenizer)
    is_special = torch.zeros(vocab, dtype=torch.bool)
    is_special[entity_ids + triggers] = True
    is_special[:3] = True  # the control tokens
    noise = torch.nonzero(~is_special).squeeze(1)
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses, start = [], time.monotonic()
    for step in range(steps):
        ids = noise[torch.randint(len(noise), (batch, length), generator=generator)]
        targets = torch.full((batch, length), -100)
        for row in range(batch):
            last, pos = None, 0
            while True:
                pos += rng.randint(1, max_gap)
                if pos >= length - 2:
                    break
                if last is None or rng.random() < 0.5:  # mention an entity
                    last = entity_ids[rng.randrange(len(entity_ids))]
                    ids[row, pos] = last
                else:  # a trigger, then the entity mentioned last
                    ids[row, pos], ids[row, pos + 1] = triggers[rng.randrange(len(triggers))], last
                    targets[row, pos] = last
                    pos += 1
        for group in optimizer.param_groups:  # warm-up, then linear decay to a tenth
            group["lr"] = lr * min(1.0, (step + 1) / 30) * max(0.1, 1 - step / steps)
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    tail = losses[-10:]
    return {"steps": steps, "loss_start": losses[0], "loss_end": sum(tail) / len(tail),
            "seconds": round(time.monotonic() - start, 1)}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to create or reuse")
    parser.add_argument("--corpus", required=True, help="JSONL corpus or text file for the tokenizer")
    parser.add_argument("--demo", action="store_true",
                        help="the CPU demo's policy (DEMO_SPEC: larger, copy pre-trained) with --extra-tokens")
    parser.add_argument("--extra-tokens", type=Path, default=None,
                        help="a file of whole words (one per line) to add as single tokens, e.g. the demo world's "
                             "vocabulary.txt (python -m igpo.demo.world)")
    args = parser.parse_args()
    spec = DEMO_SPEC if args.demo else TinyModelSpec()
    if args.extra_tokens is not None:
        if not args.extra_tokens.is_file():
            parser.error(f"--extra-tokens {args.extra_tokens}: no such file (write it with python -m igpo.demo.world)")
        words = tuple(w for w in args.extra_tokens.read_text(encoding="utf-8").split("\n") if w.strip())
        spec = replace(spec, extra_tokens=words)
    print(build_tiny_model(args.out, args.corpus, spec))


if __name__ == "__main__":
    main()
