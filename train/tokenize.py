"""Tokenizers and the token cache.

Which tokenizer a run uses (first match):
  1. --tokenizer: a tokenizer.json, a folder holding one, or `bytes`;
  2. the checkpoint's own tokenizer.json (Hugging Face folders and hub ids, our exports and run
     checkpoints, which carry the one they were trained with), or `bytes` when its metadata says so;
  3. the byte-level tokenizer when the model's vocabulary has at most 512 tokens (tiny models);
  4. otherwise an error asking for --tokenizer.
The byte-level tokenizer maps text to its UTF-8 bytes (ids 1..255; NUL bytes are dropped) and uses id 0
as end-of-text, so it needs vocab_size >= 256. A tokenizer whose vocabulary is larger than the
model's is refused, naming both sizes.

The document separator (`eos_id`: the token put after every document in training and evaluation), first match:
  1. --eos-id;
  2. the tokenizer's declared eos (tokenizer_config.json's eos_token, else the model config's eos_token_id) when
     it is an end-of-text token (END_OF_TEXT: <|endoftext|>, <|end_of_text|>, <eos>, </s>);
  3. else the vocabulary's end-of-text token, the first of END_OF_TEXT it holds: an instruct model declares its
     chat end-of-turn as eos (SmolLM2-Instruct and Qwen2.5-Instruct <|im_end|>, Llama 3 Instruct <|eot_id|>,
     Gemma-it <end_of_turn>), while its pretraining put the end-of-text token between documents (<|endoftext|>,
     <|end_of_text|>, <eos>), which the vocabulary still holds; continued pre-training on raw documents keeps it;
  4. else the declared eos (a vocabulary without an end-of-text token), else the first of EOS_CANDIDATES.
`eos_reason` says which rule chose it; a train run records both in run.json and its model card, and a resumed run
keeps the separator it started with.

Token cache: each (source split, tokenizer) is tokenized once into the entry FOLDER / KEY (FOLDER: --token-cache,
else $BAM_SURGERY_CACHE/tokens; KEY a sha256 of the data's content hash and the tokenizer's hash), holding
`tokens.bin` (raw little-endian uint16, or uint32 for vocabularies over 65,536: documents in order, each followed
by the EOS id) and `tokens.json` (its dtype and counts). The entry is runtime/cache.py's, trusted only by its one
rule (docs/safety.md, "The caches"): private, never a link, verified against the DIGEST of its files on every use
(a BLAKE3 read of tokens.bin: time linear in its size, far less than tokenizing), its .json agreeing with its .bin;
anything else (a partial, corrupt, linked or planted entry) is tokenized again. A folder that is not trusted gets
nothing written: the split is tokenized into a private temporary folder of the run (`token_cache_note` says so).
Readers memory-map tokens.bin.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np
import tokenizers
from tqdm import tqdm

from bam_surgery.converters.byte_tokenizer import (BYTE_FALLBACK_MAX_VOCAB, BYTE_VOCAB, BYTES, EOS_CANDIDATES,
                                                   TOKENIZER_KEY, unavailable_tokenizer, uses_byte_tokenizer)
from bam_surgery.converters.hf.files import check_token_ids, side_file
from bam_surgery.runtime.cache import cache_root, cached_files, find_entry, untrusted_cache

from bam_surgery.runtime.jsonfile import json_field, read_bounded, read_json

from .data import Source, file_sha256

from .errors import TrainError

if TYPE_CHECKING:
    from bam_surgery.runtime.reader import Reader

CACHE_VERSION = 2  # 2: entries are runtime/cache.py's (FOLDER / KEY / tokens.bin, tokens.json, DIGEST)
ENTRY_FILES = ("tokens.bin", "tokens.json")
_BATCH_DOCS = 512
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "<eos>", "</s>")  # the end-of-text tokens of pretraining


class ByteTokenizer:
    """UTF-8 bytes as ids (1..255; NUL dropped); id 0 ends a document."""

    name = BYTES
    vocab_size = BYTE_VOCAB
    files: tuple[Path, ...] = ()
    bos_id: int | None = None  # no beginning-of-sequence token

    def __init__(self, eos_id: int | None = None):
        self.eos_id = 0 if eos_id is None else eos_id
        self.eos_reason = "the byte tokenizer's end of text (id 0)" if eos_id is None else f"--eos-id {eos_id}"

    @property
    def fingerprint(self) -> str:
        return f"bytes-v1-eos{self.eos_id}"

    def encode_batch(self, docs: list[str]) -> list[np.ndarray]:
        out = []
        for d in docs:
            ids = np.frombuffer(d.encode("utf-8"), dtype=np.uint8)
            out.append(ids[ids != 0])
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")


MODEL_SIDE_FILES = ("chat_template.jinja", "generation_config.json")  # the model's, kept beside its tokenizer
CARRIED_SIBLINGS = ("tokenizer_config.json", "special_tokens_map.json", *MODEL_SIDE_FILES)


class HFTokenizer:
    """A `tokenizers` tokenizer.json; documents are encoded without special tokens, EOS appended."""

    def __init__(self, path: Path, eos_id: int | None = None, fallback_eos: int | None = None):
        self.path = path
        text = read_bounded(path, error=TrainError, what="a tokenizer.json")  # a regular file of at most 64 MiB
        try:
            self.tok = tokenizers.Tokenizer.from_str(text.decode("utf-8"))
        except Exception as e:  # tokenizers raises a plain Exception for malformed files (UnicodeDecodeError too)
            raise TrainError(f"{path}: not a readable tokenizer.json ({' '.join(str(e).split())[:200]})") from None
        self.name = str(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        # the files a run checkpoint carries: tokenizer.json and, only from inside its folder, its config, special
        # tokens, chat template and the model's generation config (where generate stops: the eos of the seed)
        siblings = (side_file(path.parent, n) for n in CARRIED_SIBLINGS)
        self.files = (path, *(p for p in siblings if p is not None and p.is_file()))
        self.eos_id, self.eos_reason = (eos_id, f"--eos-id {eos_id}") if eos_id is not None else \
            self._separator(fallback_eos)
        self.bos_id = self._find_bos()
        self._digest = file_sha256(path)

    @property
    def fingerprint(self) -> str:
        return f"tokenizers-{self._digest}-eos{self.eos_id}"

    def _find_bos(self) -> int | None:
        """The token the tokenizer puts before a text of its own (its post-processor: Gemma's and Llama's <bos>),
        or None (SmolLM2, GPT-2: nothing). Training and evaluation windows start with it (packing.py)."""
        try:
            plain = self.tok.encode("a", add_special_tokens=False).ids
            full = self.tok.encode("a", add_special_tokens=True).ids
        except Exception:  # noqa: BLE001 (a tokenizer that cannot encode: encoding the text says why, in one line)
            return None
        for k in range(len(full) - len(plain) + 1):
            if full[k:k + len(plain)] == plain:
                return full[k - 1] if k else None
        return None

    def _declared_eos(self, fallback: int | None) -> tuple[int | None, str]:
        """The eos the tokenizer declares: (id, where) from tokenizer_config.json's eos_token, else the model
        config's eos_token_id (`fallback`), else (None, '')."""
        cfg_file = self.path.parent / "tokenizer_config.json"
        if cfg_file.is_file():
            where = str(cfg_file)
            eos = json_field(read_json(cfg_file, expect=dict, error=TrainError), "eos_token", (str, dict), where,
                             error=TrainError)
            if isinstance(eos, dict):
                eos = json_field(eos, "content", str, f"{where}: eos_token", error=TrainError)
            if isinstance(eos, str) and self.tok.token_to_id(eos) is not None:
                return self.tok.token_to_id(eos), "tokenizer_config.json's eos_token"
        if fallback is not None:
            return fallback, "the model config's eos_token_id"
        return None, ""

    def _separator(self, fallback: int | None) -> tuple[int, str]:
        """The document separator and why (the module docstring's rule)."""
        declared, where = self._declared_eos(fallback)
        spelled = self.tok.id_to_token(declared) if declared is not None else None
        if spelled in END_OF_TEXT:
            return declared, f"{spelled} (id {declared}): {where}, an end-of-text token"
        for text in END_OF_TEXT:
            found = self.tok.token_to_id(text)
            if found is not None:
                why = f"{text} (id {found}): the vocabulary's end-of-text token"
                if declared is not None:
                    why += f", not {where} {spelled or declared} (id {declared}), a chat end-of-turn"
                return found, why
        if declared is not None:
            return declared, f"{spelled or 'token'} (id {declared}): {where} (the vocabulary has no end-of-text token)"
        for cand in EOS_CANDIDATES:
            if self.tok.token_to_id(cand) is not None:
                return self.tok.token_to_id(cand), f"{cand} (id {self.tok.token_to_id(cand)}): no eos declared"
        raise TrainError(f"{self.path}: no end-of-text token found (tokenizer_config.json eos_token, or one of "
                         f"{', '.join(EOS_CANDIDATES)}); pass --eos-id")

    def encode_batch(self, docs: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tok.encode_batch(docs, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids))


Tokenizer = ByteTokenizer | HFTokenizer


def _tokenizer_json(path: Path, where: str) -> Path:
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return path / "tokenizer.json"
        if (path / "tokenizer.model").is_file():
            raise TrainError(f"{where}: {path} has tokenizer.model but no tokenizer.json; save a fast tokenizer "
                             "(transformers: AutoTokenizer.from_pretrained(...).save_pretrained(...)) or pass "
                             "--tokenizer")
        raise TrainError(f"{where}: {path} holds no tokenizer.json")
    if path.is_file():
        return path
    if path.exists():  # /dev/zero, a FIFO: never read (it would not end, or block)
        raise TrainError(f"{where}: {path} is neither a tokenizer.json file nor a folder holding one (not a regular "
                         "file)")
    raise TrainError(f"{where}: {path}: no such file or folder")


def checkpoint_tokenizer(reader: Reader) -> str | None:
    """The tokenizer a checkpoint carries: a tokenizer.json path, 'bytes', or None."""
    for f in reader.tokenizer_files():
        if Path(f).name == "tokenizer.json":
            return str(f)
    path = reader.path
    if path is not None and Path(path).is_dir():  # a canonical folder: its tokenizer.json, from inside it

        carried = side_file(Path(path), "tokenizer.json")
        if carried is not None and carried.is_file():
            return str(carried)
    if reader.metadata.get(TOKENIZER_KEY) == BYTES:
        return BYTES
    return None


def _config_eos(reader: Reader) -> int | None:
    """The eos id of the model's config (an HF folder's config.json, a GGUF's rebuilt generation config), the
    fallback where its tokenizer names none; checked by the one rule of token ids (converters/hf/files.py)."""
    value = (reader.hf_config or {}).get("eos_token_id")
    where = reader.source_dir / "config.json" if reader.source_dir is not None else reader.path
    check_token_ids(where, "eos_token_id", value, error=TrainError)
    return value[0] if isinstance(value, list) else value


def _carried_tokenizer(reader: Reader, path: Path, eos_id: int | None) -> HFTokenizer:
    """The checkpoint's own tokenizer.json; one rebuilt from a GGUF's metadata that does not load is that GGUF's to
    name (its cache entry would tell the user nothing)."""
    try:
        return HFTokenizer(path, eos_id, fallback_eos=_config_eos(reader))
    except TrainError as e:
        if reader.metadata.get("format") != "gguf":
            raise
        raise TrainError(f"{reader.path}: the tokenizer rebuilt from its tokenizer.ggml.* metadata does not load "
                         f"({e})") from None


def resolve_tokenizer(option: str | None, reader: Reader | None, vocab_size: int,
                      eos_id: int | None = None) -> Tokenizer:
    """Apply the rules in the module docstring; check the vocabulary fits the model's."""
    if option:
        where = f"--tokenizer {option}"
        tok = ByteTokenizer(eos_id) if option == BYTES else HFTokenizer(_tokenizer_json(Path(option), where),
                                                                      eos_id)
    else:
        carried = checkpoint_tokenizer(reader) if reader is not None else None
        missing = unavailable_tokenizer(reader.metadata) if reader is not None else None
        if uses_byte_tokenizer(carried == BYTES, carried is not None or missing is not None, vocab_size):
            tok = ByteTokenizer(eos_id)
        elif carried is not None:
            tok = _carried_tokenizer(reader, Path(carried), eos_id)
        elif missing is not None:  # its own tokenizer could not be rebuilt: never bytes in its place
            raise TrainError(f"{reader.path}: its tokenizer could not be rebuilt: {missing}; pass --tokenizer "
                             "PATH/tokenizer.json")
        else:
            raise TrainError(f"no tokenizer found for a model with vocab_size {vocab_size}: the checkpoint carries "
                             "no tokenizer.json; pass --tokenizer PATH/tokenizer.json (or --tokenizer bytes)")
    if tok.vocab_size > vocab_size:
        raise TrainError(f"tokenizer {tok.name} has {tok.vocab_size} tokens but the model's vocabulary has "
                         f"{vocab_size} (vocab_size); use the model's own tokenizer")
    if not 0 <= tok.eos_id < vocab_size:
        raise TrainError(f"eos_id {tok.eos_id} is outside the model's vocabulary (vocab_size {vocab_size})")
    return tok


# ---- the cache ----------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    return cache_root() / "tokens"


def token_cache_folder(token_cache: str | Path | None) -> Path:
    """The token cache's folder: --token-cache DIR (absolute), else default_cache_dir()."""
    return Path(token_cache).absolute() if token_cache else default_cache_dir()


def token_cache_note(token_cache: str | Path | None) -> str | None:
    """Why the token cache's folder is not trusted, as the note a command shows (None: it is)."""
    folder = token_cache_folder(token_cache)
    problem = untrusted_cache(folder)
    if problem is None:
        return None
    return (f"token cache {folder} is not trusted ({problem}): tokenized into a private temporary folder of this run; "
            "pass --token-cache a folder of your own (or set BAM_SURGERY_CACHE)")


@dataclass
class TokenFile:
    """One tokenized source split: `tokens` is a read-only memory map [N] (uint16 or uint32)."""

    path: Path
    tokens: np.ndarray
    documents: int
    key: str

    def __len__(self) -> int:
        return len(self.tokens)


def cache_key(source: Source, tok: Tokenizer) -> str:
    body = f"v{CACHE_VERSION}|{source.fingerprint()}|{tok.fingerprint}"
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def tokenize_source(source: Source, tok: Tokenizer, cache_dir: Path) -> TokenFile:
    """The source split's tokens, from the cache's trusted entry or tokenized now (then cached)."""
    key = cache_key(source, tok)
    files = cached_files(Path(cache_dir).absolute(), key, ENTRY_FILES,
                         lambda folder: _write_tokens(source, tok, folder), f"{source.describe()}: the token cache",
                         usable=_meta_of,
                         hint="pass --token-cache a writable folder of your own")
    assert not isinstance(files, str)
    return _open_entry(files, source, key)


def cached_tokens(source: Source, tok: Tokenizer, cache_dir: Path) -> TokenFile | None:
    """The source split's tokens if the cache holds a trusted entry of them (nothing is written), else None."""
    key = cache_key(source, tok)
    files = find_entry(Path(cache_dir).absolute(), key, ENTRY_FILES, usable=_meta_of)
    return None if files is None else _open_entry(files, source, key)


def _meta_of(files: list[Path]) -> dict | None:
    """The entry's tokens.json if it describes its tokens.bin (this version's fields, the size they give), else
    None."""
    bin_file, meta_file = files
    try:
        meta = read_json(meta_file, expect=dict, error=ValueError)
        counts = [meta.get(k) for k in ("tokens", "documents")]
        if meta.get("version") != CACHE_VERSION or meta.get("dtype") not in ("<u2", "<u4") or \
                not all(type(c) is int and c >= 0 for c in counts):
            return None
        return meta if bin_file.stat().st_size == meta["tokens"] * np.dtype(meta["dtype"]).itemsize else None
    except (OSError, ValueError):
        return None


def _open_entry(files: list[Path], source: Source, key: str) -> TokenFile:
    bin_file = files[0]
    meta = _meta_of(files)
    if meta is None:  # changed since it was verified: only this user can
        raise TrainError(f"{bin_file}: the token cache entry changed while it was read; run again")
    dtype = np.dtype(meta["dtype"])
    if meta["tokens"] <= meta["documents"]:  # only EOS tokens
        raise TrainError(f"{source.describe()}: no text (no documents, or only empty ones)")
    return TokenFile(bin_file, np.memmap(bin_file, dtype=dtype, mode="r"), meta["documents"], key)


def _batches(docs: Iterator[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for d in docs:
        batch.append(d)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_tokens(source: Source, tok: Tokenizer, folder: Path) -> None:
    """The entry's files, written into the private folder `folder` (runtime/cache.py makes it the entry)."""
    dtype = np.dtype("<u2") if tok.vocab_size <= 1 << 16 else np.dtype("<u4")
    eos = np.array([tok.eos_id], dtype=dtype)
    n_tokens = n_docs = 0
    bar = tqdm(desc=f"tokenizing {source.describe()}", unit=" docs", leave=False, disable=not sys.stderr.isatty())
    try:
        with open(folder / ENTRY_FILES[0], "wb") as f:
            for batch in _batches(source.documents(), _BATCH_DOCS):
                bar.update(len(batch))
                for ids in tok.encode_batch(batch):
                    if len(ids) and int(ids.max()) >= 1 << (8 * dtype.itemsize):
                        raise TrainError(f"{tok.name}: token id {int(ids.max())} does not fit the cache dtype")
                    f.write(ids.astype(dtype).tobytes())
                    f.write(eos.tobytes())
                    n_tokens += len(ids) + 1
                    n_docs += 1
    finally:
        bar.close()
    if n_docs == 0:
        raise TrainError(f"{source.describe()}: no text (no documents, or only empty ones)")
    meta = {"version": CACHE_VERSION, "dtype": dtype.str, "tokens": n_tokens, "documents": n_docs,
            "source": source.describe(), "text_field": source.text_field, "tokenizer": tok.name, "eos_id": tok.eos_id}
    (folder / ENTRY_FILES[1]).write_text(json.dumps(meta, indent=1), encoding="utf-8")
