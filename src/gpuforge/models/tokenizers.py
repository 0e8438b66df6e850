"""Tokenizers by reference: `bytes` (built in), `hf:<dir>`, `bundled:<name>`."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from gpuforge.errors import ModelError

EOS = "<|endoftext|>"


@cache
def byte_tokenizer():
    """A byte-level tokenizer (256 byte symbols + end-of-text): needs no training and no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def hf_tokenizer(path: str | Path, where: str):
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"{where}: {path}: no such directory (gpuforge never downloads models)")
    try:
        # never a tokenizer's own Python (auto_map): nothing of gpuforge's asks for one
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ModelError(f"{where}: {path}: no loadable tokenizer ({str(err).splitlines()[0]})") from None


def load_tokenizer_ref(ref: str, where: str):
    if ref == "bytes":
        return byte_tokenizer()
    scheme, _, rest = ref.partition(":")
    if scheme == "hf" and rest:
        from gpuforge.policy import current

        current().check_path(where, rest)  # a server's job or replica: inside its roots, every file
        return hf_tokenizer(rest, where)
    if scheme == "bundled" and rest:
        from gpuforge.models import bundled

        return bundled.tokenizer(ref)
    raise ModelError(f"{where}: '{ref}' is not a tokenizer (bytes, hf:<dir> or bundled:<name>)")
