"""Vocabularies, with 100 sentinels (T5's, counting down from the top id): extra ids added to the
model's pieces, unless a SentencePiece file holds its own at the top (mT5's does), or ByT5's
final byte ids.

- ``embedded`` (default): a SentencePiece unigram model trained once on the embedded corpus and
  cached; T5's id layout (pad 0, eos 1, unk 2), 4000 pieces + 100 sentinels. No network.
- ``t5``: T5's standard 32k SentencePiece model, for users who can reach its GCS path.
- ``file``: a SentencePiece model file of your own (``path``).
- ``bytes``: UTF-8 bytes (seqio.ByteVocabulary), with the 100 extra ids.
- ``byt5``: ByT5's (Xue et al. 2022): UTF-8 bytes and no extra ids, its span corruption's
  sentinels the final 100 byte ids (Sec. 3.1), as its released checkpoints were trained.
"""
import hashlib
import os

import gin
import seqio
import tensorflow as tf

from t5x_variants.data import cache, corpus
from t5x_variants.features import EOS_ID, PAD_ID, UNK_ID

KINDS = ('embedded', 't5', 'file', 'bytes', 'byt5')
T5_SPM_PATH = 'gs://t5-data/vocabs/cc_all.32000/sentencepiece.model'
EXTRA_IDS = 100
EMBEDDED_PIECES = 4000


def embedded_spm_file(pieces: int = EMBEDDED_PIECES) -> str:
  """The cached SentencePiece model of the embedded corpus, trained on first use (~1 s).

  Its file name carries the corpus hash: the corpus is read from the installed Python's standard
  library, so a different Python release gives a different corpus and a differently named
  vocabulary, never silently different ids under the same name."""
  def build(tmp):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    prefix = tmp + '.spm'
    spm.SentencePieceTrainer.train(
        input=corpus.embedded_corpus_file(), model_prefix=prefix, vocab_size=pieces,
        model_type='unigram', pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1, character_coverage=1.0,
        num_threads=2, input_sentence_size=200_000, shuffle_input_sentence=True, seed_sentencepiece_size=200_000,
        minloglevel=2)
    os.replace(prefix + '.model', tmp)
    os.remove(prefix + '.vocab')
  with open(corpus.embedded_corpus_file(), 'rb') as f:
    digest = hashlib.sha256(f.read()).hexdigest()[:12]
  return cache.build_once(os.path.join(cache.cache_dir(), f'embedded_spm{pieces}_{digest}.model'), build)


@gin.configurable
def vocabulary(kind: str = 'embedded', path: str = None) -> seqio.Vocabulary:
  """The vocabulary of ``kind``; ``path`` only with ``kind='file'``, whose model must have T5's
  special ids (the models, decoding and span corruption assume them)."""
  if kind not in KINDS:
    raise ValueError(f'unknown vocabulary kind {kind!r}; valid: {", ".join(KINDS)}')
  if path is not None and kind != 'file':
    raise ValueError(f"vocabulary.path is read only with vocabulary.kind = 'file' (kind is "
                     f'{kind!r}): set both, or neither')
  if kind == 'bytes':
    return seqio.ByteVocabulary(extra_ids=EXTRA_IDS)
  if kind == 'byt5':
    return ByT5Vocabulary()
  if kind == 'file' and not (path and tf.io.gfile.exists(path)):
    raise ValueError(f"vocabulary(kind='file') needs path= an existing SentencePiece .model file, "
                     f'got {path!r}')
  spm_path = {'embedded': embedded_spm_file, 't5': lambda: T5_SPM_PATH, 'file': lambda: path}[kind]()
  vocab = seqio.SentencePieceVocabulary(spm_path, extra_ids=EXTRA_IDS)
  if kind == 'file':
    plain = seqio.SentencePieceVocabulary(spm_path)  # the file's pieces alone
    try:
      model = plain.tokenizer
    except Exception as e:  # pylint: disable=broad-except  (protobuf's or sentencepiece's)
      raise ValueError(f'vocabulary.path {path} is not a SentencePiece model '
                       f'({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}); give the '
                       f'.model file spm_train wrote (--pad_id={PAD_ID} --eos_id={EOS_ID} '
                       f'--unk_id={UNK_ID} --bos_id=-1)') from None
    ids = model.pad_id(), model.eos_id(), model.unk_id()
    if ids != (PAD_ID, EOS_ID, UNK_ID):
      raise ValueError(f'{path} has pad, eos and unk ids {ids}, not T5\'s ({PAD_ID}, {EOS_ID}, '
                       f'{UNK_ID}) that the models, decoding and span corruption use: train it '
                       f'with spm_train --pad_id={PAD_ID} --eos_id={EOS_ID} --unk_id={UNK_ID} '
                       '--bos_id=-1')
    if sentinels(plain):  # its own
      return plain
  return vocab


class ByT5Vocabulary(seqio.ByteVocabulary):
  """ByT5's vocabulary: seqio's bytes with no extra ids (259 ids), whose final ``SENTINELS`` byte
  ids its span corruption reuses as sentinels (ByT5's code counts down from the top id without a
  limit; 100, as the paper says, is this project's cap). Those ids are bytes of text as well
  (0x9C to 0xFF: UTF-8's multi-byte characters): a byte equal to the next sentinel of a
  span-corrupted row reads as that sentinel (``t5xv-data``), as the model cannot tell them apart."""
  SENTINELS = EXTRA_IDS

  def __init__(self):
    super().__init__(extra_ids=0)


def sentinels(vocab: seqio.Vocabulary) -> int:
  """How many ids at the top of ``vocab`` are sentinels: its extra ids, the 100 of a
  SentencePiece model that holds its own (mT5's, read with none added), or ByT5's final bytes."""
  if vocab.extra_ids:
    return vocab.extra_ids
  if isinstance(vocab, ByT5Vocabulary):
    return vocab.SENTINELS
  model = getattr(vocab, 'tokenizer', None)
  own = model is not None and model.id_to_piece(model.get_piece_size() - 1) == '<extra_id_0>'
  return EXTRA_IDS if own else 0


def size(vocab: seqio.Vocabulary) -> int:
  """``vocab.vocab_size``: a SentencePiece model that cannot be read (T5's, offline) is one
  ValueError naming it, not TensorFlow's file-system error at the first use."""
  try:
    return vocab.vocab_size
  except Exception as e:  # pylint: disable=broad-except  (TensorFlow's or sentencepiece's)
    path = getattr(vocab, 'sentencepiece_model_file', None)
    if path is None:
      raise
    fix = ("copy it where this machine can read it and set vocabulary.kind = 'file' and "
           "vocabulary.path to it, or use the default vocabulary.kind = 'embedded'"
           if path == T5_SPM_PATH else 'set vocabulary.path to a SentencePiece model this machine '
           'can read')
    why = str(e).strip().splitlines()[0] if str(e).strip() else '(no message)'
    raise ValueError(f'the vocabulary {path} cannot be read here ({type(e).__name__}: {why}); '
                     f'{fix}') from None
