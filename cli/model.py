"""`belayer model make-tiny DIR`: a Hugging Face model folder made on this machine, for the vLLM
engine kind (`belayer up --engine vllm --model-path DIR`) and its tests. Nothing comes from a hub.
`belayer model publish DIR`: new weights for the running vLLM engines.

The folder holds:
- a Llama config with a head size of 64 (vLLM's CPU attention refuses smaller heads);
- `model.safetensors`, seeded random weights;
- a byte-level tokenizer built with `tokenizers`: ids 0-255 are the bytes of the UTF-8 text and
  256 is `<|eos|>`, the ids of Belayer's own tokenizer (shared/tokenizer.py). So every workload,
  stop string, trajectory and the gateway's chat template mean the same tokens on both engines.
  It is a BPE over the byte alphabet with no merges: a trained vocabulary would number its
  tokens differently, and Belayer's token ids are its wire format.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from belayer_rl.shared.tokenizer import EOS_TOKEN, VOCAB_SIZE

EOS_TEXT = "<|eos|>"


def byte_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """Belayer's byte tokenizer as a `tokenizers` byte-level BPE: byte b is token b."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = byte_chars()
    if set(chars) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("tokenizers' byte-level alphabet is not GPT-2's byte mapping")
    vocab = {char: byte for byte, char in enumerate(chars)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TEXT])
    if tokenizer.token_to_id(EOS_TEXT) != EOS_TOKEN or tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError("the byte tokenizer does not number its tokens as shared/tokenizer.py does")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TEXT)


def byte_chars() -> list[str]:
    """The character the byte-level alphabet writes for each byte, in byte order (GPT-2's mapping:
    printable bytes are themselves, the other 68 are 256, 257, ... in byte order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    chars, unprintable = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + unprintable))
            unprintable += 1
    return chars


def make_tiny(folder: Path, seed: int = 0, layers: int = 2, max_len: int = 1024) -> Path:
    """Write a tiny Llama (hidden 256, 4 heads of 64, 2 key-value heads) with seeded weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        eos_token_id=EOS_TOKEN,
        bos_token_id=EOS_TOKEN,
        pad_token_id=EOS_TOKEN,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # float32: torch's default dtype
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)
    return folder


def run_make_tiny(args: argparse.Namespace) -> int:
    folder = make_tiny(args.folder, seed=args.seed, layers=args.layers)
    print(f"wrote a tiny Llama (seed {args.seed}, {args.layers} layers) to {folder}")
    return 0


def run_publish(args: argparse.Namespace) -> int:
    """Tell the vLLM engines (main and shadow workers, and the shadow supervisor for the workers it
    starts later) to load the folder's weights as a new version."""
    import uvloop

    from belayer_rl.cli.target import resolve_target
    from belayer_rl.shared import bus
    from belayer_rl.shared.model_folder import ModelFolderError, check_model_folder, folder_version
    from belayer_rl.shared.protocol import ModelPublished

    folder = args.folder.resolve()
    try:
        check_model_folder(folder)
    except ModelFolderError as exc:
        print(f"belayer model publish: {exc}", file=sys.stderr)
        return 2
    published = ModelPublished(version=folder_version(folder), path=str(folder))
    target = resolve_target(args)

    async def publish() -> None:
        nc = await target.connect("belayer-model")
        try:
            await bus.publish(nc, target.subjects.event("model_published", published.version), published)
            await nc.flush()
        finally:
            await nc.close()

    uvloop.run(publish())
    print(f"published weight version {published.version} ({folder})")
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    model = commands.add_parser("model", help="make a local model folder for the vLLM engine")
    kinds = model.add_subparsers(dest="model_command", required=True)
    tiny = kinds.add_parser("make-tiny", help="a tiny Llama with seeded weights and a byte tokenizer")
    tiny.add_argument("folder", type=Path, help="the folder to write (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.add_argument("--layers", type=int, default=2, help="decoder layers")
    tiny.set_defaults(run=run_make_tiny)
    publish = kinds.add_parser("publish", help="new weights for the running vLLM engines, replaced in place")
    publish.add_argument("folder", type=Path, help="a model folder on the engines' host")
    publish.set_defaults(run=run_publish)
