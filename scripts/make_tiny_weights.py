"""Write the seeded random weights of models/tiny-llama (and, on request, its byte-level tokenizer).

The weights are not committed: this script makes them at set-up, deterministically, so every machine serves the same
model. Why random weights and not vLLM's ``load_format="dummy"``: dummy weights make greedy decoding collapse into a
two-token cycle after a few steps, so two workers (or a worker before and after a migration) would "agree" on a token
stream for the wrong reason. Weights drawn from N(0, 0.5) (``initializer_range`` in config.json) give logits with a
standard deviation around 8 over 384 tokens, so greedy decoding has one clear argmax per step and long non-periodic
streams.

Run with an interpreter that has torch, transformers and safetensors (the vLLM venv has all three)::

    /tmp/vllm-venv/bin/python scripts/make_tiny_weights.py                  # models/tiny-llama/model.safetensors
    /tmp/vllm-venv/bin/python scripts/make_tiny_weights.py --out-dir DIR    # copies config/tokenizer into DIR too
    /tmp/vllm-venv/bin/python scripts/make_tiny_weights.py --tokenizer      # rewrite the committed tokenizer files

Skips when the weights file is already there (``--force`` rewrites it). About 6 MB, under 10 s on one core.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO_ROOT / "models" / "tiny-llama"
WEIGHTS_NAME = "model.safetensors"
SEED = 0

# Files that make up the model directory besides the weights; copied when --out-dir is not the committed directory.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")

# Tokenizer layout: ids 0..255 are the 256 bytes (id == byte value, so a prompt of N ASCII characters is N tokens),
# then the special tokens, then reserved specials up to vocab_size so that every id the model can emit decodes.
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the ``ByteLevel`` pre-tokenizer."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def write_tokenizer(model_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json: a pure byte-level BPE (no merges) plus specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    byte_map = _bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = list(SPECIAL_TOKENS) + [f"<|reserved_{i}|>" for i in range(vocab_size - 256 - len(SPECIAL_TOKENS))]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} ids, config.json says {vocab_size}")
    for name, want in (("<|bos|>", config["bos_token_id"]), ("<|eos|>", config["eos_token_id"])):
        if tok.token_to_id(name) != want:
            raise SystemExit(f"{name} got id {tok.token_to_id(name)}, config.json says {want}")
    tok.save(str(model_dir / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(config["max_position_embeddings"]),
        "chat_template": CHAT_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    print(f"wrote tokenizer ({vocab_size} ids) to {model_dir}")


def write_weights(model_dir: Path, force: bool) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    path = model_dir / WEIGHTS_NAME
    if path.exists() and not force:
        print(f"{path} exists, skipping (--force rewrites it)")
        return
    config = LlamaConfig.from_json_file(str(model_dir / "config.json"))
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    # Contiguous, unshared tensors: safetensors refuses views and tied storage.
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    tmp = path.with_suffix(".tmp")
    # One metadata key only: safetensors writes the metadata from a Rust HashMap, so with two keys their order (and
    # the file's sha256) changed from run to run although every tensor was identical (measured: 849dbeb2... and
    # a088a32a... alternating). The seed is in this script, not in the file.
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)  # safetensors creates the file 0600; other users of a shared checkout must read it
    tmp.replace(path)  # atomic: a crashed run never leaves a half-written file that a later run would skip
    n_params = sum(t.numel() for t in state.values())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    print(f"wrote {path} ({n_params} parameters, {path.stat().st_size} bytes, sha256 {digest}...)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=MODEL_DIR, help="model directory to write into")
    ap.add_argument("--force", action="store_true", help="rewrite the weights even if present")
    ap.add_argument("--tokenizer", action="store_true", help="also (re)write tokenizer.json and tokenizer_config.json")
    args = ap.parse_args(argv)

    out_dir: Path = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if out_dir != MODEL_DIR:
        for name in MODEL_FILES:
            if (MODEL_DIR / name).exists():  # the tokenizer files are absent only while bootstrapping with --tokenizer
                shutil.copyfile(MODEL_DIR / name, out_dir / name)
    if args.tokenizer:
        write_tokenizer(out_dir)
    write_weights(out_dir, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
